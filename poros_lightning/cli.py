"""The ``poros-lightning`` command: LightningCLI subcommands plus the project's own tools.

``fit``, ``validate``, ``test`` and ``predict`` go to :class:`PorosCLI` (LightningCLI; ``--config X.yaml``,
``--print_config``); ``check`` and ``doctor`` to their modules (``check`` never imports torch); ``demo`` runs
:func:`run_demo`; ``export``, ``bench`` and ``parity`` to their modules' ``main``. Each command is a library
function returning a result; this module parses arguments and prints. Everything heavy is imported lazily.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poros_lightning.errors import PorosConfigError, PorosError

if TYPE_CHECKING:
    import lightning as L

__all__ = ["DemoResult", "DemoSample", "PorosCLI", "format_demo", "generate_answers", "main", "run_demo"]  # noqa: F822

_TOOLS = ("check", "doctor", "export", "bench", "parity")
_DESCRIPTION = (
    "QLoRA fine-tuning with a streamed base. Lightning commands: fit, validate, test, predict (--config X.yaml). "
    "Also: check, doctor, demo, export, bench, parity (each takes --help)."
)
DEFAULT_DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
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
    from lightning.pytorch.cli import LightningCLI
    from typing_extensions import override

    class _PorosCLI(LightningCLI):
        """LightningCLI with poros-lightning defaults.

        ``model`` defaults to :class:`~poros_lightning.training.module.LoRALightningModule` and ``data`` to
        :class:`~poros_lightning.training.data.InstructionDataModule`; both accept ``class_path`` for your own classes.
        The optimizer is the module's own (AdamW on the adapter only), so ``--optimizer`` is not offered.
        ``--save_adapter DIR`` writes the PEFT adapter directory when ``fit`` finishes. ``fit --resume auto``
        resumes from the newest checkpoint in the :class:`~poros_lightning.lightning.checkpoint.PorosCheckpoint` dirpath if
        there is one, else starts fresh; ``fit --resume DIR`` resumes from the newest checkpoint under ``DIR`` (it
        must hold one). A ``PorosCheckpoint`` in the config keeps writing to its own dirpath; without one,
        ``--resume`` adds one writing to ``DIR`` (or ``checkpoints`` for ``auto``).
        """

        def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs: Any) -> None:
            import lightning as L

            self._resume: bool | Path | None = None
            kwargs.setdefault("seed_everything_default", 0)
            kwargs.setdefault("save_config_kwargs", {"overwrite": True})
            kwargs.setdefault("auto_configure_optimizers", False)
            kwargs.setdefault("parser_kwargs", {"prog": "poros-lightning", "description": _DESCRIPTION} if run else {})
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
                "--resume",
                type=str | None,
                default=None,
                help="fit only. 'auto': resume from the newest checkpoint in the PorosCheckpoint dirpath if there is "
                "one, else start fresh. DIR: resume from the newest checkpoint under DIR (it must hold one). A "
                "PorosCheckpoint in the config keeps writing to its dirpath; without one, one is added writing to DIR "
                "(or 'checkpoints' for auto).",
            )

        @override
        def before_instantiate_classes(self) -> None:
            config = self.config[self.subcommand] if self.subcommand else self.config
            self._resume = _resume_value(config.get("resume"), self.subcommand, config.get("ckpt_path"))

        @override
        def before_fit(self) -> None:
            adapter_dir = self.config[self.subcommand].get("save_adapter")
            if adapter_dir:
                from poros_lightning.lightning.callbacks import SaveAdapter

                self.trainer.callbacks.append(SaveAdapter(adapter_dir))
            if self._resume is not None:
                self._install_resume(self._resume)

        def _install_resume(self, resume: bool | Path) -> None:
            """Point the config's PorosCheckpoint at ``resume``, or add one that resumes and keeps writing."""
            from poros_lightning.lightning.checkpoint import PorosCheckpoint

            found = [c for c in self.trainer.callbacks if isinstance(c, PorosCheckpoint)]
            if len(found) > 1:
                raise PorosConfigError(
                    f"--resume is ambiguous: the config has {len(found)} PorosCheckpoint callbacks "
                    f"({', '.join(str(c.dirpath) for c in found)}).",
                    "Keep one PorosCheckpoint in trainer.callbacks.",
                )
            value = True if resume is True else str(resume)
            if found:
                found[0].resume = value
            else:
                dirpath = "checkpoints" if resume is True else resume
                self.trainer.callbacks.append(PorosCheckpoint(dirpath=dirpath, resume=value))

    _PorosCLI.__name__ = _PorosCLI.__qualname__ = "PorosCLI"
    _PorosCLI.__module__ = __name__
    return _PorosCLI


@functools.cache
def _cli_class() -> type:
    return _make_cli_class()


def __getattr__(name: str) -> Any:
    # `poros_lightning.cli.PorosCLI` is built on first access: importing Lightning here would make
    # `poros-lightning check` import torch.
    if name == "PorosCLI":
        return _cli_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------------- demo


@dataclass
class DemoSample:
    """One held-out prompt answered greedily before and after fine-tuning."""

    instruction: str
    reference: str
    before: str
    after: str


@dataclass
class DemoResult:
    """What :func:`run_demo` measured. Validation metrics are keyed ``val/loss``, ``val/ppl``, ``val/token_acc``."""

    config: Path
    run_dir: Path
    steps: int
    train_seconds: float
    total_seconds: float
    val_before: dict[str, float]
    val_after: dict[str, float]
    samples: list[DemoSample]
    adapter_dir: Path
    train_losses: list[float] = field(default_factory=list)
    loss_curve: Path | None = None

    @property
    def val_loss_before(self) -> float:
        """Validation loss before training."""
        return self.val_before["val/loss"]

    @property
    def val_loss_after(self) -> float:
        """Validation loss after training."""
        return self.val_after["val/loss"]


def _held_out_records(datamodule: Any, n: int) -> list[dict[str, Any]]:
    """Records from the datamodule's ``val_path``, else from the bundled validation split."""
    from poros_lightning.training.assets import tiny_instruct_path
    from poros_lightning.training.data import read_records

    path = getattr(datamodule, "val_path", None) or tiny_instruct_path("validation")
    records = [r for _, r in read_records(path)]
    # One record per task family where the data says which, so the answers show different skills.
    picked: list[dict[str, Any]] = []
    seen: set[Any] = set()
    for record in records:
        key = record.get("task", len(picked))
        if key not in seen and ("instruction" in record or "prompt" in record or "messages" in record):
            seen.add(key)
            picked.append(record)
        if len(picked) == n:
            break
    return picked


def _reference(record: dict[str, Any]) -> str:
    if "output" in record:
        return record["output"]
    if "completion" in record:
        return record["completion"]
    return next((m["content"] for m in reversed(record.get("messages", [])) if m["role"] == "assistant"), "")


def _instruction(record: dict[str, Any]) -> str:
    if "instruction" in record:
        return f"{record['instruction']} {record.get('input') or ''}".strip()
    if "prompt" in record:
        return record["prompt"]
    return next((m["content"] for m in record["messages"] if m["role"] == "user"), "")


def generate_answers(
    module: L.LightningModule, tokenizer: Any, records: list[dict[str, Any]], max_new_tokens: int = 40
) -> list[str]:
    """Answer each record's prompt (formatted exactly as in training) greedily with ``module.model``."""
    import torch

    from poros_lightning.lightning.callbacks import find_peft_model
    from poros_lightning.training.data import format_prompt

    model = find_peft_model(module)
    device = next(p.device for p in model.parameters() if p.requires_grad)
    was_training = model.training
    model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers = []
    try:
        with torch.no_grad():
            for record in records:
                ids = tokenizer(format_prompt(record, tokenizer), add_special_tokens=False, return_tensors="pt")
                ids = {k: v.to(device) for k, v in ids.items()}
                out = model.generate(
                    **ids,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=pad_id,
                )
                answers.append(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip())
    finally:
        model.train(was_training)
    return answers


def _loss_history() -> Any:
    """A Lightning callback that keeps the training loss of every step in ``.losses``."""
    import lightning as L
    from typing_extensions import override

    class LossHistory(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        @override
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss))

    return LossHistory()


def _plot_losses(losses: list[float], val_before: float, val_after: float, path: Path) -> Path | None:
    """Write the loss curve as a PNG; ``None`` without matplotlib. Uses no pyplot (global) state."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, lw=1, label="train loss (per step)")
    ax.scatter([0, len(losses)], [val_before, val_after], color="C3", zorder=3, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (response tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def run_demo(
    config: str | Path = DEFAULT_DEMO_CONFIG,
    run_dir: str | Path = "runs/demo",
    *,
    max_steps: int | None = None,
    num_samples: int = 2,
    max_new_tokens: int = 40,
    extra_args: list[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> DemoResult:
    """Fine-tune with a config end to end and show that it helped.

    Builds the model, data and trainer from ``config`` exactly as ``poros-lightning fit --config`` does, then:
    validation before, greedy answers to held-out prompts before, ``fit``, validation and answers after, the
    adapter saved to ``<run_dir>/adapter`` and (with matplotlib) the loss curve to ``<run_dir>/loss.png``.

    Args:
        config: a LightningCLI YAML (``configs/demo.yaml`` by default).
        run_dir: directory for logs, checkpoints, the adapter and the plot.
        max_steps: overrides ``trainer.max_steps``.
        num_samples: held-out prompts to answer.
        max_new_tokens: generation length.
        extra_args: more LightningCLI arguments (``["--model.lora_r=8"]``).
        progress: called with a short line as each phase starts (the CLI prints them to stderr).
    """
    say = progress or (lambda _: None)
    start = time.perf_counter()
    config = Path(config)
    if not config.is_file():
        raise PorosError(f"Demo config {str(config)!r} does not exist.", "Pass --config with a LightningCLI YAML.")
    run_dir = Path(run_dir)
    args = ["--config", str(config), f"--trainer.default_root_dir={run_dir}", *(extra_args or [])]
    if max_steps is not None:
        args.append(f"--trainer.max_steps={max_steps}")
    say(f"building model and data from {config}")
    cli = _cli_class()(args=args, run=False)
    trainer, module, datamodule = cli.trainer, cli.model, cli.datamodule
    history = _loss_history()
    trainer.callbacks.append(history)

    records = _held_out_records(datamodule, num_samples)
    say("validating before training")
    val_before = {k: float(v) for k, v in trainer.validate(module, datamodule=datamodule, verbose=False)[0].items()}
    say(f"answering {len(records)} held-out prompts before training")
    before = generate_answers(module, datamodule.tokenizer, records, max_new_tokens)
    say(f"training ({trainer.max_steps} steps)")
    fit_start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    train_seconds = time.perf_counter() - fit_start
    say("validating after training")
    val_after = {k: float(v) for k, v in trainer.validate(module, datamodule=datamodule, verbose=False)[0].items()}
    say("answering the held-out prompts after training")
    after = generate_answers(module, datamodule.tokenizer, records, max_new_tokens)

    adapter_dir = run_dir / "adapter"
    module.save_adapter(str(adapter_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    plot = _plot_losses(history.losses, val_before["val/loss"], val_after["val/loss"], run_dir / "loss.png")
    samples = [DemoSample(_instruction(r), _reference(r), b, a) for r, b, a in zip(records, before, after, strict=True)]
    return DemoResult(
        config=config,
        run_dir=run_dir,
        steps=trainer.global_step,
        train_seconds=train_seconds,
        total_seconds=time.perf_counter() - start,
        val_before=val_before,
        val_after=val_after,
        samples=samples,
        adapter_dir=adapter_dir,
        train_losses=history.losses,
        loss_curve=plot,
    )


def format_demo(result: DemoResult) -> str:
    """Render a :class:`DemoResult` as the short report ``poros-lightning demo`` prints."""
    lines = [
        f"poros-lightning demo — {result.config}",
        f"{result.steps} steps in {result.train_seconds:.0f} s (total {result.total_seconds:.0f} s)",
        "",
        f"{'metric':<16}{'before':>10}{'after':>10}",
    ]
    for key in ("val/loss", "val/ppl", "val/token_acc"):
        if key in result.val_before and key in result.val_after:
            lines.append(f"{key:<16}{result.val_before[key]:>10.4f}{result.val_after[key]:>10.4f}")
    for i, s in enumerate(result.samples, start=1):
        lines += ["", f"[{i}] {s.instruction}", f"    reference: {s.reference}"]
        lines += [f"    before:    {s.before!r}", f"    after:     {s.after!r}"]
    lines += ["", f"adapter:    {result.adapter_dir}"]
    if result.loss_curve is not None:
        lines.append(f"loss curve: {result.loss_curve}")
    return "\n".join(lines)


def _demo_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="poros-lightning demo",
        description="Fine-tune SmolLM2-135M-Instruct on the bundled data (CPU, a few minutes) and show the change.",
    )
    parser.add_argument("--config", default=str(DEFAULT_DEMO_CONFIG), help="LightningCLI YAML (default: %(default)s)")
    parser.add_argument("--run-dir", default="runs/demo", help="output directory (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=None, help="override trainer.max_steps")
    parser.add_argument("--samples", type=int, default=2, help="held-out prompts to answer (default: %(default)s)")
    args, extra = parser.parse_known_args(argv)
    start = time.perf_counter()
    result = run_demo(
        args.config,
        args.run_dir,
        max_steps=args.max_steps,
        num_samples=args.samples,
        extra_args=extra,
        progress=lambda line: print(f"[demo {time.perf_counter() - start:4.0f} s] {line}", file=sys.stderr, flush=True),
    )
    print(format_demo(result))
    return 0


# ----------------------------------------------------------------------------------------------------- main


def _tool_main(command: str) -> Any:
    try:
        module = importlib.import_module(f"poros_lightning.tools.{command}")
    except ModuleNotFoundError as err:
        if err.name != f"poros_lightning.tools.{command}":
            raise
        module = None
    tool = getattr(module, "main", None)
    if tool is None:
        raise PorosError(
            f"'poros-lightning {command}' is not available in this build of poros-lightning.",
            "Run 'poros-lightning --help' for the commands this build has.",
        )
    return tool


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``poros-lightning`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else None
    try:
        if command in _TOOLS:
            return int(_tool_main(command)(args[1:]) or 0)
        if command == "demo":
            return _demo_main(args[1:])
        import poros_lightning  # noqa: F401  (registers the "poros" strategy with Lightning)

        # LightningCLI reads sys.argv itself when no argv is given (it warns when given both).
        _cli_class()(args=None if argv is None else args)
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
