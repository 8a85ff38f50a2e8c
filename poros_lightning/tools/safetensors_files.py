"""Safetensors files read and written tensor by tensor, and the base and adapter they must match.

Invariant: nothing is memory-mapped and nothing is read whole: a tensor is read with positioned reads
into a buffer of its own and written at its planned offset, so host memory stays one tensor's working
set whatever the model's size (what ``poros-lightning export`` promises).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from poros_lightning.errors import PorosConfigError, PorosError
from poros_lightning.training.adapter import LoraFactors

__all__ = [
    "finish_out",
    "prepare_out",
    "ShardWriter",
    "TensorEntry",
    "base_tensors",
    "check_match",
    "linear_modules",
    "module_of",
    "numel",
    "parse_size",
    "read_into",
    "read_tensor",
    "resolve_base",
]


_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


# ------------------------------------------------------------------------------------------ safetensors i/o


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    name: str
    path: Path
    offset: int  # absolute, in the file
    dtype: torch.dtype
    shape: tuple[int, ...]


def _read_header(path: Path) -> list[TensorEntry]:
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _ST_DTYPES:
            raise PorosError(f"{path}: tensor {name!r} has dtype {meta['dtype']}, which export does not handle.")
        begin, end = meta["data_offsets"]
        if end - begin != numel(meta["shape"]) * _ST_DTYPES[meta["dtype"]].itemsize:
            raise PorosError(f"{path}: the header of tensor {name!r} is inconsistent; the file is corrupt.")
        out.append(TensorEntry(name, path, 8 + size + begin, _ST_DTYPES[meta["dtype"]], tuple(meta["shape"])))
    return sorted(out, key=lambda t: t.offset)


def read_into(f: Any, offset: int, buf: torch.Tensor) -> None:
    view, done = memoryview(buf.view(torch.uint8).numpy()), 0
    f.seek(offset)
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise PorosError(f"{f.name} ends before the tensor at offset {offset}: the checkpoint is truncated.")
        done += n


def read_tensor(f: Any, t: TensorEntry) -> torch.Tensor:
    buf = torch.empty(t.shape, dtype=t.dtype)
    read_into(f, t.offset, buf)
    return buf


class ShardWriter:
    """Writes one safetensors file whose header (names, dtypes, shapes) is known before the data."""

    def __init__(self, path: Path, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in entries:
            nbytes = numel(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.file = path.open("wb")
        self.file.write(len(raw).to_bytes(8, "little") + raw)
        self.expected, self.written = offset, 0

    def write(self, t: torch.Tensor) -> None:
        data = t.contiguous().view(-1).view(torch.uint8).numpy()
        self.file.write(memoryview(data))
        self.written += data.nbytes

    def close(self) -> None:
        self.file.close()
        if self.written != self.expected:  # a planning bug, never a user error
            raise RuntimeError(f"{self.file.name}: wrote {self.written} bytes, planned {self.expected}.")


def numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def parse_size(size: str | int) -> int:
    """Bytes in ``"2GB"``, ``"500MB"``, ``"1GiB"`` or an int (GB = 10**9, GiB = 2**30, as Hugging Face counts)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(size), flags=re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise PorosConfigError(f"Cannot read the size {size!r}.", "Write it like 2GB, 500MB or 1GiB.")
    unit = (match.group(2) or "B").upper()
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    return int(float(match.group(1)) * scale)


# ------------------------------------------------------------------------------------------ inputs


def resolve_base(base: str | Path) -> Path:
    path = Path(base).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PorosConfigError(f"The base directory {path} has no config.json.", "Pass a Hugging Face model dir.")
        return path
    if path.exists() or str(base).count("/") != 1:
        raise PorosConfigError(f"The base {base!r} is not a model directory.", "Pass a local Hugging Face model dir.")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(base), local_files_only=True))
    except Exception as err:  # the hub raises several types for "not in the cache"
        raise PorosConfigError(
            f"The base {base!r} is neither a local directory nor in the Hugging Face cache ({type(err).__name__}).",
            f"Download it first (hf download {base}) or pass the local directory it lives in.",
        ) from err


def base_tensors(base_dir: Path) -> list[TensorEntry]:
    index = base_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (base_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in base_dir.glob("*.bin"))
        raise PorosConfigError(
            f"{base_dir} holds no safetensors weights{f' (only {found[:3]})' if found else ''}.",
            "Re-save the base with model.save_pretrained(dir) (safetensors is the default) and export from that dir.",
        )
    return [t for name in files for t in _read_header(base_dir / name)]


def linear_modules(base_dir: Path) -> set[str]:
    """Names of every ``nn.Linear`` the model class builds (on the meta device: no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(base_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name for name, m in model.named_modules() if type(m) is nn.Linear}


def module_of(key: str, modules: set[str] | dict[str, Any]) -> str | None:
    """The module, named as in the model, that owns the checkpoint weight ``key``, if it is in ``modules``.

    Checkpoint keys are module names except for the renames transformers applies when loading (multimodal
    layouts, base-model checkpoints without the causal LM prefix); the output keeps the checkpoint's keys.
    """
    if not key.endswith(".weight"):
        return None
    name = key.removesuffix(".weight")
    candidates = [name]
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model.language_model.")):
        if name.startswith(old):
            candidates.append(new + name[len(old) :])
    if name.startswith("language_model.lm_head"):
        candidates.append(name[len("language_model.") :])
    if not name.startswith("model."):
        candidates.append("model." + name)
    return next((c for c in candidates if c in modules), None)


def check_match(loras: dict[str, LoraFactors], owner: dict[str, TensorEntry], adapter_config: dict[str, Any]) -> None:
    trained_on = adapter_config.get("base_model_name_or_path") or "unknown"
    hint = f"Pass the base the adapter was trained on (its adapter_config.json says {trained_on!r})."
    absent = [m for m in loras if m not in owner]
    if absent:
        raise PorosConfigError(
            f"{len(absent)} LoRA target(s) are not weights of the base, e.g. {absent[0]!r}.weight.",
            hint,
        )
    for module, lora in loras.items():
        shape = owner[module].shape
        if shape != (lora.b.shape[0], lora.a.shape[1]):
            raise PorosConfigError(
                f"The LoRA update of {module!r} is {lora.b.shape[0]}x{lora.a.shape[1]}, its base weight {shape}.",
                hint,
            )


def prepare_out(out: Path, force: bool) -> Path:
    """A fresh ``<out>.tmp`` directory to write into; ``out`` itself is replaced only by :func:`finish_out`."""
    if out.exists() and not out.is_dir():
        raise PorosConfigError(f"The output {out} is a file.", "Pass a directory path to -o.")
    if out.exists() and any(out.iterdir()) and not force:
        raise PorosConfigError(f"The output {out} already exists and is not empty.", "Pass --force to replace it.")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # what an interrupted export left behind
    tmp.mkdir(parents=True)
    return tmp


def finish_out(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` into place: an interrupted export never leaves a half-written ``out``."""
    old = out.with_name(out.name + ".old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
