"""Errors raised by poros-lightning.

Every error states the problem, the offending value, and a ``HINT:`` line with the next step. Each
subclasses a builtin (``ValueError``, ``MemoryError``, ...) so generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "PorosError",
    "PorosOOMError",
    "UnsupportedArchitectureError",
    "PorosConfigError",
    "DataError",
    "ResumeMismatchError",
    "NonFiniteLossError",
]


def _message(problem: str, hint: str | None) -> str:
    return f"{problem}\nHINT: {hint}" if hint else problem


class PorosError(Exception):
    """Base class of every poros-lightning error. ``hint`` says how to fix it."""

    def __init__(self, problem: str, hint: str | None = None) -> None:
        super().__init__(_message(problem, hint))
        self.problem = problem
        self.hint = hint


class PorosOOMError(PorosError, MemoryError):
    """A block, a plan or a pinned allocation does not fit the memory available.

    Attributes:
        needed_bytes: the memory that would have fitted, in bytes, where the raiser knows it (the planner's
            smallest plan); ``None`` otherwise.
    """

    def __init__(self, problem: str, hint: str | None = None, *, needed_bytes: int | None = None) -> None:
        super().__init__(problem, hint)
        self.needed_bytes = needed_bytes


class UnsupportedArchitectureError(PorosError, ValueError):
    """The model's ``model_type`` is not in the architecture registry."""


class PorosConfigError(PorosError, ValueError):
    """An option or a combination of options is invalid."""


class DataError(PorosError, ValueError):
    """A dataset is empty or a record is malformed."""


class ResumeMismatchError(PorosError, ValueError):
    """A checkpoint was written by a run whose model, adapter or engine options differ."""


class NonFiniteLossError(PorosError, FloatingPointError):
    """The training loss became NaN or infinite."""
