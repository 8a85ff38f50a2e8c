"""The ``poros-lightning`` command: LightningCLI subcommands plus the project's own tools.

``fit``, ``validate``, ``test`` and ``predict`` go to :class:`PorosCLI` (LightningCLI, in :mod:`poros_lightning.lightning.lightning_cli`; ``--config X.yaml``,
``--print_config``); ``check`` and ``doctor`` to their modules (``check`` never imports torch); ``demo`` runs
:func:`poros_lightning.tools.demo.run_demo`; ``export``, ``bench`` and ``parity`` to their modules' ``main``. Each command is a library
function returning a result; this module parses arguments and prints. Everything heavy is imported lazily.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from poros_lightning._logging import logs_on_stderr
from poros_lightning.errors import PorosError
from poros_lightning.training.assets.configs import bundled_configs, resolve_config_args

__all__ = ["PorosCLI", "format_help", "main"]  # noqa: F822

# Each tool's entry module parses its arguments before importing torch, so `poros-lightning X --help` is instant.
_TOOLS = {
    "check": "poros_lightning.tools.check",
    "doctor": "poros_lightning.tools.doctor",
    "export": "poros_lightning.tools.export_cli",
    "bench": "poros_lightning.tools.bench",
    "parity": "poros_lightning.tools.parity",
}
_COMMANDS = (
    ("fit", "train from a LightningCLI config: --config PATH or a shipped name (--resume auto|DIR, --save_adapter)"),
    ("validate", "run the validation loop of a config"),
    ("test", "run the test loop of a config"),
    ("predict", "run the prediction loop of a config"),
    ("check", "is a model supported, and which memory plan fits a VRAM budget (no torch import)"),
    ("doctor", "versions, GPU, pinned host-to-device bandwidth, and what to fix"),
    ("demo", "fine-tune the bundled SmolLM2-135M on the bundled data on the CPU and show the change"),
    ("export", "merge a LoRA adapter into its base and write a Hugging Face checkpoint"),
    ("bench", "run benchmarks (JSONL) and render reports"),
    ("parity", "resident vs streamed on every surface, torch.equal"),
)


def __getattr__(name: str) -> Any:
    # `poros_lightning.cli.PorosCLI` is built on first access: importing Lightning here would make
    # `poros-lightning check` import torch.
    if name == "PorosCLI":
        from poros_lightning.lightning.lightning_cli import cli_class

        return cli_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------------- main


def _tool_main(command: str) -> Any:
    try:
        module = importlib.import_module(_TOOLS[command])
    except ModuleNotFoundError as err:
        if err.name != _TOOLS[command]:
            raise
        module = None
    tool = getattr(module, "main", None)
    if tool is None:
        raise PorosError(
            f"'poros-lightning {command}' is not available in this build of poros-lightning.",
            "Run 'poros-lightning --help' for the commands this build has.",
        )
    return tool


def format_help() -> str:
    """``poros-lightning --help``: the commands and the shipped configs, printed without importing torch."""
    width = max(len(name) for name, _ in _COMMANDS)
    lines = ["usage: poros-lightning COMMAND [options]   (poros-lightning COMMAND --help for its options)", ""]
    lines += ["QLoRA fine-tuning of large Hugging Face causal LMs with the frozen NF4 base streamed from host RAM.", ""]
    lines += ["commands:"] + [f"  {name:<{width}}  {text}" for name, text in _COMMANDS]
    lines += ["", "shipped configs (--config NAME works from any folder):"]
    for kind, command in (("", "fit"), ("bench", "bench run"), ("parity", "parity --config")):
        lines.append(f"  {command + ':':<16} {', '.join(bundled_configs(kind))}")
    lines += ["", "e.g. poros-lightning fit --config tiny-cpu      (a tiny random model on the CPU, in seconds)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``poros-lightning`` console script; returns the exit status.

    Only the Lightning commands (fit, validate, test, predict) and ``demo`` import Lightning; ``--help`` and the
    tools answer without it.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else None
    try:
        if command in (None, "-h", "--help"):
            print(format_help(), file=sys.stdout if command else sys.stderr)
            return 0 if command else 2
        if command == "--version":
            from poros_lightning import __version__

            print(f"poros-lightning {__version__}")
            return 0
        if command in _TOOLS:
            return int(_tool_main(command)(args[1:]) or 0)
        with logs_on_stderr():
            if command == "demo":
                from poros_lightning.tools.demo import main as demo_main

                return demo_main(args[1:])
            from poros_lightning.lightning.lightning_cli import cli_class

            cli_class()(args=resolve_config_args(args))
            return 0
    except Exception as err:
        # jsonargparse wraps errors raised while instantiating a class_path in a ValueError: report ours plainly.
        cause = _poros_cause(err)
        if cause is None:
            raise
        print(f"poros-lightning: error: {cause}", file=sys.stderr)
        return 1


def _poros_cause(err: BaseException | None) -> PorosError | None:
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, PorosError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
