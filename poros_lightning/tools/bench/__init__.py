"""Benchmarks: the harness, the YAML-driven runner and the HTML report (``poros-lightning bench``)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``poros-lightning bench``."""
    from poros_lightning.tools.bench.cli import main as _main

    return _main(argv)


__all__ = ["main"]
