"""Each registered family's certification status (``status.json``), its GPU gates, and what they guarantee.

A family is ``certified`` only with gate files under ``docs/validation/``: the committed raw results of
resident-vs-streamed parity runs, equal on all four surfaces. ``status.json`` lists every gate of a model type
with the checkpoint it was built from and its scale, so an installed package (which ships no
``docs/validation/``) still knows how far each guarantee reaches; ``tests/test_arch.py`` checks the list
against the files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["Gate", "gates", "guarantee", "largest_gate", "scale_params", "statuses"]

_GUARANTEES: dict[str, str] = {
    "certified": "bit-identical to a resident run, gated on GPU up to {scale}: {gate}",
    "experimental": "bit-identical on CPU parity tests in CI; no GPU gate yet",
    "target": "planned, not supported yet",
}


@dataclass(frozen=True)
class Gate:
    """One committed GPU parity gate: its JSONL file, the checkpoint whose config it built, and that scale."""

    file: str
    model: str
    scale: str

    @property
    def params(self) -> float:
        return scale_params(self.scale)


def scale_params(scale: str) -> float:
    """``"72B"`` -> 72e9, ``"1.5B"`` -> 1.5e9, ``"135M"`` -> 135e6; 0 for a label that is not a size."""
    units = {"B": 1e9, "M": 1e6}
    try:
        return float(scale[:-1]) * units[scale[-1].upper()]
    except (ValueError, KeyError, IndexError):
        return 0.0


@cache
def statuses() -> dict[str, dict[str, Any]]:
    data = json.loads((Path(__file__).with_name("status.json")).read_text())
    return {key: value for key, value in data.items() if not key.startswith("_")}


def gates(model_type: str, table: dict[str, dict[str, Any]] | None = None) -> tuple[Gate, ...]:
    """The committed gates of ``model_type``, smallest scale first."""
    entry = (table if table is not None else statuses()).get(model_type, {})
    found = [Gate(g["file"], g["model"], g["scale"]) for g in entry.get("gates", [])]
    return tuple(sorted(found, key=lambda g: (g.params, g.file)))


def largest_gate(model_type: str, table: dict[str, dict[str, Any]] | None = None) -> Gate | None:
    """The gate at the largest scale of ``model_type``, or None when it has none."""
    found = gates(model_type, table)
    return found[-1] if found else None


def guarantee(status: str, gate: Gate | str | None = None) -> str:
    """The guarantee text for a status (``gate``: the largest gate of a certified entry, or its file)."""
    if gate is None or isinstance(gate, str):
        return _GUARANTEES[status].format(scale="?", gate=gate or "docs/validation/")
    return _GUARANTEES[status].format(scale=f"{gate.scale} ({gate.model})", gate=gate.file)
