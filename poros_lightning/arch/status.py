"""Each registered family's certification status (``status.json``) and what it guarantees.

A family is ``certified`` only with a gate file under ``docs/validation/``: the committed raw result of a
resident-vs-streamed parity run, equal on all four surfaces.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["guarantee", "statuses"]

_GUARANTEES: dict[str, str] = {
    "certified": "bit-identical to a resident run, gated on GPU: {gate}",
    "experimental": "bit-identical on CPU parity tests in CI; no GPU gate yet",
    "target": "planned, not supported yet",
}


def guarantee(status: str, gate: str | None = None) -> str:
    """The guarantee text for a status (``gate`` is the validation file of a certified entry)."""
    return _GUARANTEES[status].format(gate=gate or "docs/validation/")


@cache
def statuses() -> dict[str, dict[str, Any]]:
    data = json.loads((Path(__file__).with_name("status.json")).read_text())
    return {key: value for key, value in data.items() if not key.startswith("_")}
