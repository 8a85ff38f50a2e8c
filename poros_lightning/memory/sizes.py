"""Sizes: bitsandbytes' storage of a quantized weight, and sizes written as people write them (``"8GB"``).

Torch-free; exact for what bitsandbytes stores (see :mod:`poros_lightning.memory.estimate`)."""

from __future__ import annotations

import re

from poros_lightning.errors import PorosConfigError

__all__ = [
    "QUANTIZATIONS",
    "BF16",
    "LORA_BYTES_PER_PARAM",
    "ceil_div",
    "format_bytes",
    "parse_bytes",
    "quantized_weight_bytes",
]

QUANTIZATIONS = ("nf4-dq", "nf4", "fp4", "none")

_BLOCKSIZE = 64  # bitsandbytes 4-bit quantization block
_NESTED_BLOCKSIZE = 256  # blocks of the double-quantized absmax
BF16 = 2
LORA_BYTES_PER_PARAM = 4 + 4 + 8  # fp32 weight, fp32 gradient, two fp32 Adam moments

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int) -> int:
    """Parse a size: an int (bytes) or a string such as ``"8GB"`` (8e9), ``"8GiB"`` (8·2**30), ``"512MB"``.

    Decimal units (kB, MB, GB, TB; the bare letters K, M, G, T alike) are powers of 1000; binary units (KiB,
    MiB, GiB, TiB) powers of 1024. Case is ignored.

    Raises:
        PorosConfigError: the value is negative or not a size.
    """
    if isinstance(value, bool):
        raise PorosConfigError(f"invalid size {value!r}.", hint="give bytes as an int, or a string like '8GB'.")
    if isinstance(value, int):
        if value < 0:
            raise PorosConfigError(f"invalid size {value!r}: negative.", hint="give a positive size like '8GB'.")
        return value
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise PorosConfigError(
            f"invalid size {value!r}.",
            hint="write a number with a unit: '8GB' (10^9 bytes), '8GiB' (2^30 bytes), '512MB', or plain bytes.",
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """Human-readable decimal size: ``7.24 GB``."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quantized_weight_bytes(numel: int, quantization: str = "nf4-dq") -> int:
    """Bytes bitsandbytes stores for one linear weight of ``numel`` elements (the shared code tables aside).

    ``nf4-dq``: packed codes ``ceil(n/2)`` + uint8 absmax ``ceil(n/64)`` + fp32 nested absmax
    ``4·ceil(ceil(n/64)/256)`` + a 4-byte fp32 offset (≈ 4.127 bits per weight). ``nf4`` and ``fp4``: packed
    codes + fp32 absmax ``4·ceil(n/64)`` (4.5 bits). ``none``: bf16, 2 bytes per weight.
    """
    if quantization == "none":
        return BF16 * numel
    packed = ceil_div(numel, 2)
    blocks = ceil_div(numel, _BLOCKSIZE)
    if quantization == "nf4-dq":
        return packed + blocks + 4 * ceil_div(blocks, _NESTED_BLOCKSIZE) + 4
    if quantization in ("nf4", "fp4"):
        return packed + 4 * blocks
    raise PorosConfigError(f"unknown quantization {quantization!r}.", hint=f"use one of {', '.join(QUANTIZATIONS)}.")
