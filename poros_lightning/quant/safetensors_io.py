"""Safetensors files read and written a layer at a time, with digests that tell a changed file.

Invariant: a tensor kept from a mapped file is a private copy (Note: [mapped reads] in
:mod:`poros_lightning.quant.cache`), so the mapped pages never outlive the layer being read.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TensorSpec", "digest", "file_sha256", "iter_layers", "layer_index", "plan_shards", "private_copy", "quick_digest",
    "safetensors_keys", "shard_name", "trim_host_memory", "write_safetensors",
]  # fmt: skip


_QUICK_BYTES = 1 << 20
_HASH_CHUNK = 16 << 20
_COPY_CHUNK = 64 << 20
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ST_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
              torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
              torch.float64: "F64"}  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor of a safetensors file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


def layer_index(name: str) -> int:
    """Decoder layer index in a tensor name (``model.layers.3.mlp...`` -> 3); -1 outside the layers."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else -1


# --- safetensors I/O ---------------------------------------------------------------------------------


def safetensors_keys(path: Path) -> list[str]:
    """The tensor names of a safetensors file (reads the header only)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def iter_layers(path: Path, keys: Iterable[str]) -> Iterator[tuple[Any, list[str]]]:
    """Open a safetensors file once per decoder layer and yield ``(handle, keys of that layer)``.

    See Note: [mapped reads]. The handle closes, and freed heap memory goes back to the system, when
    the caller moves on to the next layer.
    """
    from safetensors import safe_open

    groups: dict[int, list[str]] = {}
    for k in keys:
        groups.setdefault(layer_index(k), []).append(k)
    for layer in sorted(groups):
        with safe_open(str(path), framework="pt") as f:
            yield f, groups[layer]
        trim_host_memory()


def private_copy(path: Path, key: str, view: torch.Tensor) -> torch.Tensor:
    """A copy of a mapped tensor in the process's own memory (see Note: [mapped reads]).

    Tensors larger than 64 MiB are copied in row chunks, each through a mapping closed right after,
    so the pages mapped for the copy never exceed one chunk.
    """
    row_bytes = view[0].numel() * view.element_size() if view.dim() else 0
    if view.numel() * view.element_size() <= _COPY_CHUNK or row_bytes == 0:
        return view.clone()
    from safetensors import safe_open

    out = torch.empty(view.shape, dtype=view.dtype)
    step = max(1, _COPY_CHUNK // row_bytes)
    for start in range(0, view.shape[0], step):
        with safe_open(str(path), framework="pt") as f:
            out[start : start + step].copy_(f.get_tensor(key)[start : start + step])
    return out


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def trim_host_memory() -> None:
    """Return freed heap memory to the system (glibc ``malloc_trim``; a no-op elsewhere).

    Quantizing frees many mid-sized temporaries; glibc keeps them in its arenas, and the RSS would
    grow by memory the process no longer uses.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def quick_digest(path: Path) -> str:
    """SHA-256 of the file size, its first MiB and its last MiB."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_QUICK_BYTES))
        if size > _QUICK_BYTES:
            f.seek(max(size - _QUICK_BYTES, _QUICK_BYTES))
            h.update(f.read(_QUICK_BYTES))
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """SHA-256 of a whole file, read in 16 MiB chunks (plain reads: nothing is mapped)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digest(path: Path, sha256: str | None = None) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256 or file_sha256(path), "quick": quick_digest(path)}


def write_safetensors(
    path: Path, specs: Sequence[TensorSpec], tensors: Iterable[torch.Tensor], metadata: dict[str, str] | None = None
) -> dict[str, Any]:
    """Stream tensors into a safetensors file, one at a time, hashing the bytes as they are written.

    The header is built from ``specs``, so the file is written front to back and no more than one
    tensor is held for it. ``tensors`` yields the tensors in the order of ``specs`` (on any device).

    Returns:
        ``{"size", "sha256", "quick"}`` of the file.

    Raises:
        ValueError: a tensor does not match its spec, or there are more or fewer tensors than specs.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": _ST_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            h.update(chunk)
        for spec, tensor in zip(specs, tensors, strict=True):
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{spec.name}: got {tensor.dtype} {tuple(tensor.shape)}, planned {spec}")
            flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            data = memoryview(flat.numpy()) if flat.numel() else memoryview(b"")
            f.write(data)
            h.update(data)
        f.flush()
        os.fsync(f.fileno())
    return digest(path, h.hexdigest())


def plan_shards(specs: Sequence[TensorSpec], groups: Sequence[object], shard_bytes: int) -> list[list[TensorSpec]]:
    """Split ``specs`` into shards of about ``shard_bytes``, cutting only where the group changes."""
    shards: list[list[TensorSpec]] = [[]]
    size, previous = 0, object()
    for spec, group in zip(specs, groups, strict=True):
        if shards[-1] and group != previous and size + spec.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
        previous = group
    return [s for s in shards if s]


def shard_name(i: int, n: int) -> str:
    """``model.safetensors`` for one shard, else ``model-00001-of-00003.safetensors``."""
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
