"""What poros-lightning tells the user through ``logging``, and where the command line shows it.

Long phases before training (quantizing, pinning) log counts, ``what 40/80 (12 s)`` at each tenth, at INFO. The
``poros-lightning`` command shows the ``poros_lightning`` logger's INFO records on stderr (:func:`logs_on_stderr`);
a library user sees them where their logging sends them (nowhere by default), and tests stay quiet.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

__all__ = ["log_count", "logs_on_stderr"]


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


@contextlib.contextmanager
def logs_on_stderr() -> Iterator[None]:
    """Show the ``poros_lightning`` logger's INFO records on stderr while inside, as Lightning shows its own.

    A ``poros_lightning`` logger that already has a handler (the application configured it) is left as it is.
    """
    logger = logging.getLogger("poros_lightning")
    if logger.handlers:
        yield
        return
    handler, level = logging.StreamHandler(), logger.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
