"""Data files shipped with poros-lightning.

``tiny_instruct/`` holds a small generated instruction dataset (``train.jsonl``, ``validation.jsonl``) in the
instruction/input/output schema; :mod:`poros_lightning.training.assets.make_tiny_instruct` regenerates it byte for byte.
"""

from __future__ import annotations

from pathlib import Path

from poros_lightning.errors import DataError

__all__ = ["ASSETS_DIR", "TINY_INSTRUCT_DIR", "tiny_instruct_path"]

ASSETS_DIR = Path(__file__).resolve().parent
TINY_INSTRUCT_DIR = ASSETS_DIR / "tiny_instruct"


def tiny_instruct_path(split: str = "train") -> Path:
    """Return the path of a split (``"train"`` or ``"validation"``) of the bundled tiny instruction dataset."""
    if split not in ("train", "validation"):
        raise DataError(f"unknown split {split!r} of the bundled dataset.", "use 'train' or 'validation'.")
    return TINY_INSTRUCT_DIR / f"{split}.jsonl"
