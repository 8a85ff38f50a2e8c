"""Bundled config facts of well-known checkpoints, so ``poros-lightning check`` plans them offline.

Invariant: every entry in ``known_configs.json`` holds values copied from the checkpoint's published
``config.json`` (only the keys the planner and ``check`` read); a key whose published value is not recorded
is left out rather than guessed, and the family defaults fill it.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["known_config", "known_ids"]


@cache
def _known() -> dict[str, dict[str, Any]]:
    data = json.loads(Path(__file__).with_name("known_configs.json").read_text())
    return {key: value for key, value in data.items() if not key.startswith("_")}


def known_ids() -> list[str]:
    """The hub ids whose config facts ship with poros-lightning, sorted."""
    return sorted(_known())


def known_config(hub_id: str) -> dict[str, Any] | None:
    """The bundled config dict of ``hub_id`` (case-insensitive), or None when it is not bundled."""
    table = _known()
    if hub_id in table:
        return json.loads(json.dumps(table[hub_id]))
    lowered = {key.lower(): key for key in table}
    key = lowered.get(hub_id.lower())
    return json.loads(json.dumps(table[key])) if key else None
