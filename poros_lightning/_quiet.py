"""Silence third-party messages a poros-lightning user cannot act on, each by its exact text.

Invariant: only the messages listed here are hidden, matched by their beginning and (for warnings) their category;
never a whole category, module or logger. Everything else reaches the user as before. ``import poros_lightning``
installs the filters; importing this module imports neither torch nor any of the libraries whose messages it hides.
"""

from __future__ import annotations

import logging
import re
import warnings

__all__ = ["LOG_MESSAGES", "WARNINGS", "install"]

WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # PEFT's PeftModel.__init__ reads transformers' deprecated alias; our own code uses the new names.
    ("`is_gradient_checkpointing` is deprecated", FutureWarning),
    # Lightning 2.6's pytree helper against torch's newer pytree API: nothing a user can change.
    ("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning),
    # Lightning's history note on its default logger (CSVLogger without tensorboard): it works as is.
    ("Starting from v1.9.0, `tensorboardX` has been removed as a dependency", UserWarning),
)
"""(beginning of the message, category) of each warning hidden."""

LOG_MESSAGES: dict[str, tuple[str, ...]] = {
    # bitsandbytes tries an optional kernel from the Hugging Face hub on CPUs with avx512_bf16 and falls back to its
    # own; offline (as poros-lightning runs) the attempt always fails, with a warning.
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    # Lightning's advertisements for its cloud services (litlogger, litmodels), at every fit.
    "lightning.pytorch.utilities.rank_zero": ("💡 Tip:",),
    "lightning.fabric.utilities.rank_zero": ("💡 Tip:",),
}
"""Logger name -> beginnings of the messages dropped from it."""


class _DropMessages(logging.Filter):
    """Drops the records whose message begins with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def install() -> None:
    """Add the filters (again, in front, where they were already added: idempotent)."""
    for message, category in WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    for name, prefixes in LOG_MESSAGES.items():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _DropMessages)]:
            logger.removeFilter(old)
        logger.addFilter(_DropMessages(prefixes))
