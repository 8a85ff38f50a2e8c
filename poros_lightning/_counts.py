"""Logged counts for the long phases before training (quantizing, pinning): ``what 40/80 (12 s)`` at each tenth.

Plain ``logging`` at INFO: the ``poros-lightning`` command shows it on stderr; a library user sees it where their
logging sends ``poros_lightning``'s records (nowhere by default), and tests stay quiet.
"""

from __future__ import annotations

import logging
import time

__all__ = ["log_count"]


def log_count(log: logging.Logger, what: str, done: int, total: int, start: float, *, min_total: int = 8) -> None:
    """Log ``"<what> <done>/<total> (<seconds> s)"`` when ``done`` reaches a tenth of ``total``, and at the end.

    Args:
        log: the logger of the module doing the work.
        what: the phase, e.g. ``"poros: pinning host store blocks"``.
        done: units finished so far (1-based).
        total: units in the phase; phases shorter than ``min_total`` units log nothing.
        start: ``time.perf_counter()`` when the phase began.
    """
    if total < min_total or not log.isEnabledFor(logging.INFO):
        return
    if done == total or done % max(1, total // 10) == 0:
        log.info("%s %d/%d (%.0f s)", what, done, total, time.perf_counter() - start)
