"""PorosCLI: LightningCLI with poros-lightning's defaults, and ``--resume`` checked before anything is built.

Built on first use (:func:`cli_class`): importing Lightning at import time would make ``poros-lightning check``
and ``--help`` import torch.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poros_lightning.errors import PorosConfigError

if TYPE_CHECKING:
    import lightning as L


__all__ = ["DESCRIPTION", "cli_class", "register_strategies"]


DESCRIPTION = (
    "QLoRA fine-tuning with a streamed base. Lightning commands: fit, validate, test, predict (--config X.yaml). "
    "Also: check, doctor, demo, export, bench, parity (each takes --help)."
)
_RESUME_HINT = (
    "Use --resume auto (resume from the newest checkpoint in the PorosCheckpoint dirpath if there is one, else "
    "start fresh) or --resume DIR (a PorosCheckpoint dirpath holding step-<N>/ directories)."
)


def _resume_value(value: str | None, subcommand: str | None, ckpt_path: str | None) -> bool | Path | None:
    """Check ``--resume`` before anything is built: ``True`` for ``auto``, the directory for ``DIR``, else ``None``.

    Raises:
        PorosConfigError: ``--resume`` outside ``fit``, next to ``--ckpt_path``, or neither ``auto`` nor a directory.
        ResumeMismatchError: ``DIR`` holds no checkpoint.
    """
    if value is None:
        return None
    if subcommand != "fit":
        where = f"'poros-lightning {subcommand}'" if subcommand else "a PorosCLI built with run=False"
        raise PorosConfigError(
            f"--resume is an option of 'poros-lightning fit' only, not of {where}.",
            "Drop --resume, or run 'poros-lightning fit --config X.yaml --resume auto'.",
        )
    if ckpt_path is not None:
        raise PorosConfigError(
            f"--resume {value!r} and --ckpt_path {ckpt_path!r} are both set.",
            "Resume from a PorosCheckpoint directory with --resume (exact), or from a Lightning .ckpt with "
            "--ckpt_path, not both.",
        )
    if value == "auto":
        return True
    path = Path(value)
    if not value.strip() or not path.is_dir():
        raise PorosConfigError(f"--resume {value!r} is neither 'auto' nor an existing directory.", _RESUME_HINT)
    from poros_lightning.lightning.checkpoint import resume_source

    resume_source(path, path)  # fails now, before the model is built, when DIR holds no checkpoint
    return path


def _make_cli_class() -> type:
    """Build :class:`PorosCLI` on first use, so that ``import poros_lightning.cli`` stays light."""
    from jsonargparse import ActionYesNo
    from lightning.pytorch.cli import LightningCLI
    from typing_extensions import override

    class _PorosCLI(LightningCLI):
        """LightningCLI with poros-lightning defaults.

        ``model`` defaults to :class:`~poros_lightning.training.module.LoRALightningModule` and ``data`` to
        :class:`~poros_lightning.training.data.InstructionDataModule`; both accept ``class_path`` for your own classes.
        The optimizer is the module's own (AdamW on the adapter only), so ``--optimizer`` is not offered.
        ``--save_adapter DIR`` writes the PEFT adapter directory when ``fit`` finishes.

        ``fit`` checkpoints for an exact resume by default (:mod:`poros_lightning.lightning.resume`): the config's
        :class:`~poros_lightning.lightning.checkpoint.PorosCheckpoint`, else one writing to
        ``<trainer.default_root_dir>/checkpoints`` (``--no_poros_checkpoint``: none). ``fit --resume auto`` resumes
        from the newest checkpoint there if there is one, else starts fresh and says so (naming a Lightning
        ``.ckpt`` it found, and how to use it); ``fit --resume DIR`` resumes from the newest checkpoint under ``DIR``
        (it must hold one).
        """

        def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs: Any) -> None:
            import lightning as L

            self._resume: bool | Path | None = None
            kwargs.setdefault("seed_everything_default", 0)
            kwargs.setdefault("save_config_kwargs", {"overwrite": True})
            kwargs.setdefault("auto_configure_optimizers", False)
            kwargs.setdefault("parser_kwargs", {"prog": "poros-lightning", "description": DESCRIPTION} if run else {})
            super().__init__(
                L.LightningModule,
                L.LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                args=args,
                run=run,
                **kwargs,
            )

        @override
        def parse_arguments(self, parser: Any, args: Any) -> None:
            # LightningCLI warns when `args` is given while sys.argv holds arguments too, in case a script mixed
            # them up. Here `args` is deliberate: `main` passes sys.argv[1:] with shipped config names resolved, and
            # `run_demo` its own list inside the `demo` command. So `args` alone is parsed, with no warning.
            from jsonargparse import Namespace

            if isinstance(args, (dict, Namespace)):
                self.config = parser.parse_object(args)
            else:
                self.config = parser.parse_args(sys.argv[1:] if args is None else args)

        @override
        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.set_defaults(
                {
                    "model": {"class_path": "poros_lightning.training.module.LoRALightningModule"},
                    "data": {"class_path": "poros_lightning.training.data.InstructionDataModule"},
                }
            )
            parser.add_argument(
                "--save_adapter",
                type=str | None,
                default=None,
                help="Directory to write the PEFT adapter (adapter_config.json + safetensors) to after fit.",
            )
            parser.add_argument(
                "--poros_checkpoint",
                action=ActionYesNo,
                default=True,
                help="fit only. Write exact-resume checkpoints (PorosCheckpoint: every 100 steps and at the end) to "
                "<trainer.default_root_dir>/checkpoints, unless the config has a PorosCheckpoint of its own. "
                "--no_poros_checkpoint (poros_checkpoint: false in the config): none.",
            )
            parser.add_argument(
                "--resume",
                type=str | None,
                default=None,
                help="fit only. 'auto': resume from the newest checkpoint in the PorosCheckpoint dirpath if there is "
                "one, else start fresh (and say so). DIR: resume from the newest checkpoint under DIR (it must hold "
                "one), and keep writing there unless the config has a PorosCheckpoint.",
            )

        @override
        def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
            # PorosProgressBar unless the config turns the bar off or brings its own.
            from lightning.pytorch.callbacks import ProgressBar

            from poros_lightning.lightning.progress import PorosProgressBar

            config = self.config_init[self.subcommand] if self.subcommand else self.config_init
            trainer = {**config.get("trainer", {}), **kwargs}
            callbacks = trainer.get("callbacks") or []
            callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
            if trainer.get("enable_progress_bar") is not False and not any(
                isinstance(c, ProgressBar) for c in callbacks
            ):
                kwargs["callbacks"] = [*callbacks, PorosProgressBar()]
            return super().instantiate_trainer(**kwargs)

        @override
        def before_instantiate_classes(self) -> None:
            config = self.config[self.subcommand] if self.subcommand else self.config
            self._resume = _resume_value(config.get("resume"), self.subcommand, config.get("ckpt_path"))

        @override
        def before_fit(self) -> None:
            config = self.config[self.subcommand]
            adapter_dir = config.get("save_adapter")
            if adapter_dir:
                from poros_lightning.lightning.callbacks import SaveAdapter

                self.trainer.callbacks.append(SaveAdapter(adapter_dir))
            from poros_lightning.lightning.resume import install_poros_checkpoint

            install_poros_checkpoint(self.trainer, self._resume, enabled=config.get("poros_checkpoint", True))

    _PorosCLI.__name__ = _PorosCLI.__qualname__ = "PorosCLI"
    _PorosCLI.__module__ = __name__
    return _PorosCLI


@functools.cache
def cli_class() -> type:
    """The PorosCLI class (LightningCLI), built once; registers the ``poros`` strategies first."""
    register_strategies()  # the console script skips it at import (see poros_lightning._light_import)
    return _make_cli_class()


def register_strategies() -> None:
    """Register ``"poros"`` and ``"poros_ddp"`` with Lightning's strategy registry (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from poros_lightning.lightning.ddp import PorosDDPStrategy
    from poros_lightning.lightning.strategy import PorosStrategy

    PorosStrategy.register_strategies(StrategyRegistry)
    PorosDDPStrategy.register_strategies(StrategyRegistry)
