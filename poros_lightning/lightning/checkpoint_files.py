"""Checkpoint directories on disk: written atomically, read back without running code.

A checkpoint is ``<dirpath>/step-<N>/``, safetensors and JSON files only. It is written into ``step-<N>.tmp/``
(every file and the directory fsync'ed), then renamed; the ``latest`` pointer is replaced atomically afterwards.
A crash at any moment leaves the previous checkpoint whole, and :func:`load_latest` skips an incomplete or
corrupt one with a warning. What goes into the files is :mod:`poros_lightning.lightning.checkpoint`'s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from poros_lightning.errors import ResumeMismatchError

__all__ = [
    "FILES",
    "no_checkpoint",
    "Checkpoint",
    "load_checkpoint",
    "load_latest",
    "resume_source",
    "write_checkpoint",
]


FILES = ("adapter.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json", "rng.safetensors",
         "rng.json", "meta.json")  # fmt: skip
_STEP = re.compile(r"^step-(\d+)$")
_LATEST = "latest"


# ------------------------------------------------------------------------------------------------ files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}, str(path))
    _fsync_file(path)


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@dataclass
class Checkpoint:
    """A checkpoint read back from disk (every file parsed, so a corrupt one fails at load time)."""

    path: Path
    meta: dict[str, Any]
    adapter: dict[str, torch.Tensor]
    optimizer_tensors: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    schedulers: list[dict[str, Any]]
    rng_tensors: dict[str, torch.Tensor]
    rng: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["global_step"])


def write_checkpoint(dirpath: Path, step: int, files: dict[str, Any], keep_last: int = 2) -> Path:
    """Write ``files`` (``*.safetensors``: tensor dicts; ``*.json``: JSON objects) as ``step-<step>`` atomically."""
    dirpath.mkdir(parents=True, exist_ok=True)
    final, tmp = dirpath / f"step-{step}", dirpath / f"step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name in FILES:  # meta.json last: it is the file a reader checks first
        (_write_tensors if name.endswith(".safetensors") else _write_json)(tmp / name, files[name])
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(dirpath)
    _replace_text(dirpath / _LATEST, final.name + "\n")
    for old in _step_dirs(dirpath)[keep_last:]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in dirpath.glob("step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _step_dirs(dirpath: Path) -> list[Path]:
    """Complete-looking checkpoint directories, newest first."""
    found = [(int(m.group(1)), p) for p in dirpath.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read every file of checkpoint directory ``path``.

    Raises:
        ResumeMismatchError: a file is missing or unreadable.
    """
    path = Path(path)
    missing = [name for name in FILES if not (path / name).is_file()]
    if missing:
        raise ResumeMismatchError(f"Checkpoint {path} is incomplete: {missing} missing.", "Resume from another one.")
    try:
        meta = json.loads((path / "meta.json").read_text())
        return Checkpoint(
            path=path,
            meta=meta,
            adapter=load_file(str(path / "adapter.safetensors")),
            optimizer_tensors=load_file(str(path / "optimizer.safetensors")),
            optimizer=json.loads((path / "optimizer.json").read_text()),
            schedulers=json.loads((path / "scheduler.json").read_text())["schedulers"],
            rng_tensors=load_file(str(path / "rng.safetensors")),
            rng=json.loads((path / "rng.json").read_text()),
        )
    except (OSError, ValueError, KeyError, RuntimeError) as err:  # JSONDecodeError is a ValueError
        raise ResumeMismatchError(f"Checkpoint {path} is corrupt: {err}", "Resume from another one.") from err


def load_latest(dirpath: str | Path) -> Checkpoint | None:
    """The newest loadable checkpoint under ``dirpath`` (``None``: there is none).

    The ``latest`` pointer is tried first, then every ``step-<N>`` directory from the newest; an incomplete
    or corrupt one is skipped with a warning.
    """
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return None
    candidates = _step_dirs(dirpath)
    pointer = dirpath / _LATEST
    if pointer.is_file() and (dirpath / pointer.read_text().strip()) in candidates:
        candidates.insert(0, candidates.pop(candidates.index(dirpath / pointer.read_text().strip())))
    for path in candidates:
        try:
            return load_checkpoint(path)
        except ResumeMismatchError as err:
            warnings.warn(f"Skipping checkpoint {path}: {err.problem}", stacklevel=2)
    return None


def no_checkpoint(source: Path) -> ResumeMismatchError:
    where = "" if source.is_dir() else " (no such directory)"
    if _STEP.match(source.name):
        where += f"; it is named like one checkpoint: resume takes the directory holding them, {source.parent}"
    return ResumeMismatchError(
        f"No loadable checkpoint under {source}{where}.",
        "Resume from the dirpath of a PorosCheckpoint run (it holds step-<N>/ directories), or use --resume auto "
        "(PorosCheckpoint(resume=True)) to resume when a checkpoint exists and start fresh otherwise.",
    )


def resume_source(resume: bool | str | Path | None, dirpath: str | Path) -> Path | None:
    """The directory ``PorosCheckpoint(dirpath, resume=resume)`` resumes from, checked without loading anything.

    Args:
        resume: ``False``/``None``: no resume; ``True``: ``dirpath`` if it holds a checkpoint; a path: that
            directory, which must hold one.
        dirpath: the callback's checkpoint directory.

    Returns:
        The directory to load from, or ``None``: the run starts fresh.

    Raises:
        ResumeMismatchError: ``resume`` is a path with no checkpoint directory under it.
    """
    if resume is None or resume is False or resume == "":
        return None
    source = Path(dirpath) if resume is True else Path(resume)
    if source.is_dir() and _step_dirs(source):
        return source
    if resume is True:
        return None
    raise no_checkpoint(source)
