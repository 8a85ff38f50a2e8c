"""What ``poros-lightning export`` can be asked for, torch-free: its command line offers it without importing torch."""

from __future__ import annotations

__all__ = ["MERGE_INTO"]

MERGE_INTO: tuple[str, ...] = ("nf4", "original")
"""What the update is added to: the dequantized base the adapter trained against, or the original weights."""
