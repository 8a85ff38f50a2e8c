"""``poros-lightning fit`` checkpoints for an exact resume by default, and says what ``--resume auto`` will do.

Invariant: a ``fit`` run from the command line has a :class:`~poros_lightning.lightning.checkpoint.PorosCheckpoint` unless the
user turned it off (``--no_poros_checkpoint``): the config's own, else one writing to
``<trainer.default_root_dir>/checkpoints``, a folder that stays the same from one run to the next (Lightning's
``version_N`` log folders do not), so ``--resume auto`` finds what the previous run wrote.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from poros_lightning.errors import PorosConfigError
from poros_lightning.lightning.checkpoint import PorosCheckpoint, resume_source

__all__ = ["DEFAULT_DIRNAME", "auto_resume_message", "install_poros_checkpoint", "lightning_checkpoints"]

log = logging.getLogger(__name__)

DEFAULT_DIRNAME = "checkpoints"
"""The default PorosCheckpoint folder, under ``trainer.default_root_dir``."""


def install_poros_checkpoint(trainer: Any, resume: bool | Path | None, enabled: bool = True) -> PorosCheckpoint | None:
    """Give ``trainer`` its PorosCheckpoint and point it at ``resume``; returns it (``None``: checkpoints are off).

    Args:
        trainer: the Lightning ``Trainer`` about to fit.
        resume: ``True`` for ``--resume auto``, a directory for ``--resume DIR``, ``None`` for a fresh run.
        enabled: ``False`` for ``--no_poros_checkpoint``: add none (a PorosCheckpoint in the config still runs).

    Raises:
        PorosConfigError: ``--resume`` with several PorosCheckpoint callbacks, or with checkpoints turned off.
    """
    found = [c for c in trainer.callbacks if isinstance(c, PorosCheckpoint)]
    if len(found) > 1:
        if resume is None:
            return found[0]  # the config's own choice: each writes to its dirpath
        raise PorosConfigError(
            f"--resume is ambiguous: the config has {len(found)} PorosCheckpoint callbacks "
            f"({', '.join(str(c.dirpath) for c in found)}).",
            "Keep one PorosCheckpoint in trainer.callbacks.",
        )
    if not found and not enabled:
        if resume is not None:
            raise PorosConfigError(
                "--resume needs checkpoints, and --no_poros_checkpoint turns them off.",
                "Drop --no_poros_checkpoint (or poros_checkpoint: false in the config) to resume.",
            )
        return None
    if found:
        callback = found[0]
    else:
        # --resume DIR keeps writing into DIR, so the next --resume DIR continues from the newest checkpoint.
        dirpath = resume if isinstance(resume, Path) else Path(trainer.default_root_dir) / DEFAULT_DIRNAME
        callback = PorosCheckpoint(dirpath=dirpath)
        trainer.callbacks.append(callback)
    if resume is not None:
        callback.resume = True if resume is True else str(resume)
    _report(trainer, callback)
    return callback


def lightning_checkpoints(trainer: Any) -> list[Path]:
    """Lightning ``.ckpt`` files where this trainer's ``ModelCheckpoint`` writes them, newest first.

    Looks in each ``ModelCheckpoint``'s explicit ``dirpath``, and in ``<save_dir>/<name>/version_*/checkpoints`` of
    the loggers and of ``<default_root_dir>/lightning_logs`` (where the previous runs' versions are).
    """
    folders: set[Path] = set()
    for callback in trainer.callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if type(callback).__name__ == "ModelCheckpoint" and dirpath:
            folders.add(Path(dirpath))
    roots = {Path(trainer.default_root_dir) / "lightning_logs"}
    for logger in getattr(trainer, "loggers", []):
        save_dir, name = getattr(logger, "save_dir", None), getattr(logger, "name", None)
        if save_dir:
            roots.add(Path(save_dir) / name if name else Path(save_dir))
    for root in roots:
        folders.update(p for p in root.glob("*/checkpoints") if p.is_dir())
    files = {f for folder in folders if folder.is_dir() for f in folder.glob("*.ckpt") if f.is_file()}
    return sorted(files, key=lambda f: f.stat().st_mtime, reverse=True)


def auto_resume_message(dirpath: Path, newest: str | None, lightning_ckpts: list[Path]) -> str:
    """What ``--resume auto`` does: resume from ``newest`` (a ``step-<N>`` in ``dirpath``), or start fresh.

    Starting fresh, the message names the newest Lightning ``.ckpt`` if there is one, and how to resume from it.
    """
    if newest is not None:
        return f"--resume auto: resuming exactly from the PorosCheckpoint {Path(dirpath) / newest}."
    if not lightning_ckpts:
        return (
            f"--resume auto: no PorosCheckpoint checkpoint in {dirpath} and no Lightning .ckpt: starting a fresh run "
            f"(its checkpoints go to {dirpath})."
        )
    ckpt = lightning_ckpts[0]
    return (
        f"--resume auto: no PorosCheckpoint checkpoint in {dirpath}, only the Lightning checkpoint {ckpt}"
        f"{f' (and {len(lightning_ckpts) - 1} older)' if len(lightning_ckpts) > 1 else ''}: starting a fresh run "
        f"(its checkpoints go to {dirpath}). To continue from the .ckpt instead, run the same command with "
        f"--ckpt_path {ckpt} in place of --resume auto (adapter, optimizer and loop counters; not bit-exact: "
        "a .ckpt holds no data position and no RNG states)."
    )


def _newest(dirpath: Path) -> str | None:
    """The name of the newest ``step-<N>`` folder in ``dirpath``, read from names only (nothing is loaded)."""
    if resume_source(True, dirpath) is None:
        return None
    pointer = Path(dirpath) / "latest"
    if pointer.is_file() and (Path(dirpath) / pointer.read_text().strip()).is_dir():
        return pointer.read_text().strip()
    steps = [p.name for p in Path(dirpath).glob("step-*") if p.is_dir() and p.name.removeprefix("step-").isdigit()]
    return max(steps, key=lambda name: int(name.removeprefix("step-")))


def _report(trainer: Any, callback: PorosCheckpoint) -> None:
    if callback.resume is True:
        newest = _newest(callback.dirpath)
        message = auto_resume_message(callback.dirpath, newest, [] if newest else lightning_checkpoints(trainer))
        (log.info if newest else log.warning)(message)
    elif callback.resume:  # --resume DIR: the CLI checked that DIR holds a checkpoint
        log.info(
            "--resume: resuming exactly from the PorosCheckpoint %s.",
            Path(callback.resume) / str(_newest(callback.resume)),
        )
    elif (newest := _newest(callback.dirpath)) is not None:
        log.warning(
            "%s holds checkpoints of an earlier run (newest: %s); this run starts fresh and writes its own there. To "
            "continue the earlier run instead, add --resume auto.",
            callback.dirpath,
            newest,
        )
