"""``poros-lightning demo``: fine-tune the bundled SmolLM2-135M on the bundled data on the CPU and show the change.

Builds the run exactly as ``poros-lightning fit --config`` does (:func:`~poros_lightning.lightning.lightning_cli.cli_class`),
then shows validation, held-out answers before and after, how many of them are right, the adapter and the loss curve.

Note: [scoring the answers]
    A reply is right when its answer is the reference answer: the text after ``Answer:`` up to the first
    period, compared exactly. A reply without an ``Answer:`` field (the model before training answers in its own
    words) is right when the reference answer occurs in it as a whole word or phrase, anywhere. That rule is
    lenient to the untrained model (a reply that names two candidates counts as right), so the count of answers
    that training turned from wrong to right is, if anything, low.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poros_lightning.training.assets.configs import configs_dir, resolve_config

if TYPE_CHECKING:
    import lightning as L


from poros_lightning.lightning.lightning_cli import cli_class

__all__ = [
    "DEFAULT_DEMO_CONFIG",
    "DemoResult",
    "DemoSample",
    "answer_field",
    "format_demo",
    "generate_answers",
    "is_right",
    "main",
    "run_demo",
]

DEFAULT_DEMO_CONFIG = configs_dir() / "demo.yaml"
"""The shipped demo config (package data of an installed poros-lightning)."""


def answer_field(text: str) -> str | None:
    """The text after ``Answer:`` up to the first period that ends a sentence, or None without the field."""
    match = re.search(r"Answer:\s*(.*?)(?:\.(?:\s|$)|$)", text, flags=re.DOTALL)
    return match.group(1).strip() if match else None


def is_right(reply: str, reference: str) -> bool:
    """Whether ``reply`` gives the reference's answer (Note: [scoring the answers])."""
    expected = answer_field(reference)
    if expected is None:
        expected = reference.strip()
    given = answer_field(reply)
    if given is not None:
        return given == expected
    return re.search(r"(?<!\w)" + re.escape(expected) + r"(?!\w)", reply) is not None


@dataclass
class DemoSample:
    """One held-out prompt answered greedily before and after fine-tuning."""

    instruction: str
    reference: str
    before: str
    after: str

    @property
    def right_before(self) -> bool:
        return is_right(self.before, self.reference)

    @property
    def right_after(self) -> bool:
        return is_right(self.after, self.reference)


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

    @property
    def right_before(self) -> int:
        """Held-out answers right before training (Note: [scoring the answers])."""
        return sum(s.right_before for s in self.samples)

    @property
    def right_after(self) -> int:
        """Held-out answers right after training."""
        return sum(s.right_after for s in self.samples)

    @property
    def improved(self) -> int:
        """Held-out answers wrong before training and right after."""
        return sum(s.right_after and not s.right_before for s in self.samples)


def _held_out_records(datamodule: Any, n: int) -> list[dict[str, Any]]:
    """Records from the datamodule's ``val_path``, else from the bundled validation split."""
    from poros_lightning.training.assets import tiny_instruct_path
    from poros_lightning.training.data import read_records

    path = getattr(datamodule, "val_path", None) or tiny_instruct_path("validation")
    records = [r for _, r in read_records(path)]
    records = [r for r in records if "instruction" in r or "prompt" in r or "messages" in r]
    # Round-robin over the task families where the data says which, so the answers show every skill.
    families: dict[Any, list[dict[str, Any]]] = {}
    for i, record in enumerate(records):
        families.setdefault(record.get("task", i), []).append(record)
    picked: list[dict[str, Any]] = []
    for rank in range(max((len(f) for f in families.values()), default=0)):
        picked += [f[rank] for f in families.values() if rank < len(f)]
    return picked[:n]


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
    num_samples: int = 10,
    max_new_tokens: int = 40,
    extra_args: list[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> DemoResult:
    """Fine-tune with a config end to end and show that it helped.

    Builds the model, data and trainer from ``config`` exactly as ``poros-lightning fit --config`` does, then:
    validation before, greedy answers to held-out prompts before, ``fit``, validation and answers after, the
    adapter saved to ``<run_dir>/adapter`` and (with matplotlib) the loss curve to ``<run_dir>/loss.png``.

    Args:
        config: a LightningCLI YAML, or a shipped config's name (``demo``, the default; ``tiny-cpu``).
        run_dir: directory for logs, checkpoints, the adapter and the plot.
        max_steps: overrides ``trainer.max_steps``.
        num_samples: held-out prompts to answer.
        max_new_tokens: generation length.
        extra_args: more LightningCLI arguments (``["--model.lora_r=8"]``).
        progress: called with a short line as each phase starts (the CLI prints them to stderr).
    """
    say = progress or (lambda _: None)
    start = time.perf_counter()
    config = resolve_config(config)
    run_dir = Path(run_dir)
    args = ["--config", str(config), f"--trainer.default_root_dir={run_dir}", *(extra_args or [])]
    if max_steps is not None:
        args.append(f"--trainer.max_steps={max_steps}")
    say(f"building model and data from {config}")
    cli = cli_class()(args=args, run=False)
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
    n = len(result.samples)
    if n:
        lines += [
            "",
            f"held-out answers right: {result.right_before}/{n} before, {result.right_after}/{n} after "
            f"({result.improved} wrong before and right after)",
            "  right: the 'Answer:' field equals the reference's; a reply without one must contain the reference answer",
        ]
    mark = {True: "right", False: "wrong"}
    for i, s in enumerate(result.samples, start=1):
        lines += ["", f"[{i}] {s.instruction}", f"    reference: {s.reference}"]
        lines += [
            f"    before:    {s.before!r}  [{mark[s.right_before]}]",
            f"    after:     {s.after!r}  [{mark[s.right_after]}]",
        ]
    lines += ["", f"adapter:    {result.adapter_dir}"]
    if result.loss_curve is not None:
        lines.append(f"loss curve: {result.loss_curve}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``poros-lightning demo``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="poros-lightning demo",
        description="Fine-tune SmolLM2-135M-Instruct on the bundled data (CPU, a few minutes) and show the change.",
    )
    parser.add_argument(
        "--config",
        default=str(DEFAULT_DEMO_CONFIG),
        help="LightningCLI YAML: a path or a shipped config's name, e.g. tiny-cpu (default: %(default)s)",
    )
    parser.add_argument("--run-dir", default="runs/demo", help="output directory (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=None, help="override trainer.max_steps")
    parser.add_argument("--samples", type=int, default=10, help="held-out prompts to answer (default: %(default)s)")
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
