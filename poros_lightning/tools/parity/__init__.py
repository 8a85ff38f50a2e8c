"""Resident-vs-streamed parity gates and their JSONL artifacts (``poros-lightning parity``)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``poros-lightning parity``."""
    from poros_lightning.tools.parity.cli import main as _main

    return _main(argv)


__all__ = ["main"]
