"""poros-lightning: QLoRA fine-tuning of large Hugging Face causal LMs on a small GPU.

The frozen NF4 base lives in pinned host RAM and streams through the GPU one block of decoder layers
at a time; the trained adapter is bit-identical to a fully resident run.

``import poros_lightning`` registers the ``"poros"`` strategy with Lightning, so
``Trainer(strategy="poros")`` works, and hides a few third-party messages nobody can act on (see ``_quiet``).
"""

from __future__ import annotations

import os
import sys

__version__ = "0.1.0"

__all__ = [
    "DataError",
    "InstructionDataModule",
    "LoRALightningModule",
    "MicroBatchSampler",
    "PorosConfigError",
    "PorosDDPStrategy",
    "PorosCheckpoint",
    "PorosError",
    "PorosOOMError",
    "PorosPrecision",
    "PorosStrategy",
    "SaveAdapter",
    "SystemMetrics",
    "UnsupportedArchitectureError",
    "__version__",
    "prepare",
    "unprepare",
]

from poros_lightning import _quiet  # noqa: E402
from poros_lightning.errors import (  # noqa: E402
    DataError,
    PorosConfigError,
    PorosError,
    PorosOOMError,
    UnsupportedArchitectureError,
)

_quiet.install()  # before Lightning, PEFT or bitsandbytes is imported: hides their noise the user cannot act on


def _light_import() -> bool:
    """The ``poros-lightning`` command imports Lightning only for the commands that train (see ``cli.main``).

    So ``poros-lightning --help``, ``check``, ``doctor``, ``export --help``... answer without importing torch. The
    command is recognised by its console script's name or by ``python -m poros_lightning.cli``; any other process
    (a library user's ``import poros_lightning``) registers the strategies at import.
    """
    if os.environ.get("POROS_LIGHTNING_LIGHT") == "1":
        return True
    script = os.path.basename(sys.argv[0] if sys.argv else "")
    if script in ("poros-lightning", "poros-lightning.exe", "poros-lightning-script.py"):
        return True
    # While `python -m poros_lightning.cli` imports this package, sys.argv[0] is still "-m": read the real command.
    argv = getattr(sys, "orig_argv", [])
    return "-m" in argv and argv[argv.index("-m") + 1 : argv.index("-m") + 2] == ["poros_lightning.cli"]


_LAZY = {
    "prepare": "poros_lightning.api",
    "unprepare": "poros_lightning.api",
    "PorosStrategy": "poros_lightning.lightning.strategy",
    "PorosDDPStrategy": "poros_lightning.lightning.ddp",
    "MicroBatchSampler": "poros_lightning.lightning.ddp",
    "PorosPrecision": "poros_lightning.lightning.precision",
    "LoRALightningModule": "poros_lightning.training.module",
    "InstructionDataModule": "poros_lightning.training.data",
    "PorosCheckpoint": "poros_lightning.lightning.checkpoint",
    "SaveAdapter": "poros_lightning.lightning.callbacks",
    "SystemMetrics": "poros_lightning.lightning.callbacks",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'poros_lightning' has no attribute {name!r}")


def _register() -> None:
    """Register ``"poros"`` and ``"poros_ddp"`` with Lightning's strategy registry (idempotent)."""
    from poros_lightning.lightning.lightning_cli import register_strategies

    register_strategies()


if not _light_import():
    _register()
