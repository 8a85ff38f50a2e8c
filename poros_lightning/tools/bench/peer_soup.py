"""The Soup peer: ``soup train`` with layer streaming on the bench's checkpoint, as its users run it.

Soup's users write a ``soup.yaml`` and run ``soup train --config soup.yaml``; its layer streaming
(``training.stream_layers: true``, ``quantization: 4bit``) keeps the NF4 base in host memory and streams each decoder
layer to the GPU, training through TRL's ``SFTTrainer``. Here its data is the bench's token batches as a
pre-tokenized dataset (``data.format: pre_tokenized``, the layout ``soup data preprocess`` writes), one epoch of
exactly ``warmup + steps`` optimizer steps, and its CLI runs in this process with one addition: a trainer callback
that times each optimizer step (synchronized at its start and end) and reads the peaks. With ``spec["profile"]``
(``bench run --profile``, CUDA) the epoch has one more step, which the callback runs under the CUDA profiler as
``bench run --profile`` profiles ours (``profile_*`` fields; the backward runs inside the ``forward`` phase, as in
our accumulating runs and the other peers').
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from poros_lightning.tools.bench.peers import bench_batches

__all__ = ["soup_config", "soup_crash", "train_soup"]


def soup_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``soup.yaml`` of a peer run: the bench's shape (LoRA, batch, accumulation, AdamW, lr), streamed NF4."""
    r = int(spec["lora_r"])
    return {
        "base": spec["checkpoint"],
        "task": "sft",
        "data": {
            "train": "./train.jsonl",
            "format": "pre_tokenized",
            "tokenized_path": "./tokenized",
            "max_length": int(spec["seq_len"]),
            "val_split": 0.0,
        },
        "training": {
            "epochs": 1,
            "lr": 1e-4,
            "batch_size": int(spec["batch_size"]),
            "gradient_accumulation_steps": int(spec["accumulate"]),
            "optimizer": "adamw_torch",
            "warmup_ratio": 0.0,
            "save_steps": 10**6,  # no checkpoint inside the timed steps
            "logging_steps": 1,
            "seed": int(spec.get("seed", 0)),
            "quantization": "4bit",
            "stream_layers": True,
            "lora": {"r": r, "alpha": 2 * r, "dropout": 0.0, "target_modules": list(spec["targets"])},
        },
        "output": "./output",
    }


def _write_data(spec: dict[str, Any], work: Path) -> None:
    """The bench's batches, row by row, as the pre-tokenized dataset and as the ``data.train`` file it names."""
    from datasets import Dataset

    rows = int(spec["batch_size"]) * int(spec["accumulate"])
    count = spec["warmup"] + spec["steps"] + (1 if spec.get("profile") else 0)  # the profiled step last
    batches = bench_batches(spec["vocab"], rows, spec["seq_len"], count)
    ids = [row.tolist() for batch in batches for row in batch]
    columns = {"input_ids": ids, "labels": ids, "attention_mask": [[1] * len(i) for i in ids]}
    Dataset.from_dict(columns).save_to_disk(str(work / "tokenized"))
    with (work / "train.jsonl").open("w") as f:
        for i in ids:
            f.write(json.dumps({"input_ids": i, "labels": i}) + "\n")


def _timer(
    reset_peaks: Callable[[], None],
    sync: Callable[[], None],
    read_peaks: Callable[[], dict[str, float | None]],
    times: list[float],
    peaks: dict[str, float | None],
    warmup: int,
    steps: int | None = None,
    profiler: Any = None,
) -> Any:
    """A ``TrainerCallback`` timing each optimizer step, from its first micro-batch to its update, keeping the last
    logged loss and reading the peaks when training ends (into ``peaks``). With a ``profiler``
    (:class:`~poros_lightning.tools.bench.timeline.CudaProfile`), the step after the ``warmup + steps`` timed ones
    runs under it, untimed: its figures go into ``peaks`` as ``profile_*``."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.step = 0
            self.start = 0.0

        def _profiled(self) -> bool:
            return profiler is not None and steps is not None and self.step == warmup + steps

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.step == 0:
                reset_peaks()
            sync()
            if self._profiled():
                profiler.start()
                profiler.mark()  # the forward (with each micro-batch's backward) begins
            self.start = time.perf_counter()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._profiled():
                profiler.mark()
                profiler.mark()  # no backward phase of its own, as in the other peers' profiled steps

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync()
            if self._profiled():
                profiler.mark()
                try:  # the timed steps are in hand: a profile that cannot be read loses nothing else
                    peaks.update({f"profile_{k}": v for k, v in profiler.stop().items()})
                except Exception as err:  # noqa: BLE001 - e.g. a trainer that skipped a phase's callback
                    peaks["profile_error"] = f"{type(err).__name__}: {err}"
            elif self.step >= warmup and (steps is None or self.step < warmup + steps):
                times.append(time.perf_counter() - self.start)
            self.step += 1

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                peaks["final_loss"] = float(logs["loss"])

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            peaks.update(read_peaks())  # before Soup saves the adapter

    return StepTimer()


def train_soup(
    spec: dict[str, Any],
    reset_peaks: Callable[[], None],
    sync: Callable[[], None],
    read_peaks: Callable[[], dict[str, float | None]],
) -> dict[str, Any]:
    """Run ``soup train`` in this process's work directory (the cwd) on ``spec``; its timed steps and peaks."""
    import transformers

    work = Path.cwd()
    started = time.time()
    # Soup's layer cache (the NF4 layers it streams) beside the checkpoint, shared by the runs of every length.
    os.environ.setdefault("SOUP_LAYER_STREAM_CACHE_DIR", str(Path(spec["checkpoint"]).parent / "soup-layer-cache"))
    _write_data(spec, work)
    (work / "soup.yaml").write_text(yaml.safe_dump(soup_config(spec), sort_keys=False))
    times: list[float] = []
    peaks: dict[str, float | None] = {"peak_vram_gb": None, "peak_reserved_gb": None}
    profiler = None
    if spec.get("profile"):
        import torch

        from poros_lightning.tools.bench.timeline import CudaProfile

        profiler = CudaProfile() if torch.cuda.is_available() else None
    timer = _timer(reset_peaks, sync, read_peaks, times, peaks, int(spec["warmup"]), int(spec["steps"]), profiler)
    original = transformers.Trainer.__init__

    failed: list[BaseException] = []  # what a trainer's train() raised: Soup prints it and exits 1

    def init(self: Any, *args: Any, **kwargs: Any) -> None:  # every trainer Soup builds gets the timer
        original(self, *args, **kwargs)
        self.add_callback(timer)
        train = self.train

        def recorded(*a: Any, **k: Any) -> Any:
            try:
                return train(*a, **k)
            except Exception as exc:
                failed.append(exc)
                raise

        self.train = recorded

    transformers.Trainer.__init__ = init
    hidden = [name for name in _NOT_SOUPS if name not in sys.modules]
    for name in hidden:  # Note: [Soup without Unsloth]
        sys.modules[name] = None  # type: ignore[assignment]  # `import unsloth` raises ImportError
    argv = sys.argv
    sys.argv = ["soup", "--no-telemetry", "--no-audit-log", "--verbose", "train", "--config", "soup.yaml", "--yes"]
    code: Any = 0
    try:
        from soup_cli.cli import run

        run()
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = argv
        transformers.Trainer.__init__ = original
        for name in hidden:
            sys.modules.pop(name, None)
    if len(times) < int(spec["steps"]):
        raise RuntimeError(
            f"soup train exited with code {code} after {len(times)} timed steps of {spec['steps']}"
            + (soup_crash(work, started) or _first_line(failed))
        )
    return {"times": times, "soup_exit_code": code, **peaks}


# Note: [Soup without Unsloth]
# With Unsloth importable, `soup train` fails before its first step on a streamed model: Soup asks whether Unsloth is
# installed (to suggest `backend: unsloth`) by importing it, importing Unsloth patches TRL's SFTTrainer so that its
# `train()` first runs unsloth_zoo's `fix_untrained_tokens`, and that reads the embeddings, which layer streaming
# keeps on the meta device (`NotImplementedError` from `torch.nonzero` on meta, H200 run of 2026-12-07). Soup's
# users train on its default backend, transformers, in an environment of Soup's own; the bench's peers share one
# package folder, so Soup's process makes Unsloth unimportable instead.
_NOT_SOUPS = ("unsloth", "unsloth_zoo")


def _first_line(errors: list[BaseException]) -> str:
    """``": Type: message"`` of the first exception a Soup trainer's ``train()`` raised (its first line), or ''."""
    if not errors:
        return ""
    err = errors[0]
    return f": {type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"


def soup_crash(work: Path, since: float) -> str:
    """Soup's own error from the crash bundle it writes for any exception in setup or training
    (``<work>/.soup-crashes/*.crash``, JSON with ``error.type`` and ``error.message``), newer than ``since``; or ''."""
    bundles = [p for p in (work / ".soup-crashes").glob("*.crash") if p.stat().st_mtime >= since]
    if not bundles:
        return ""
    try:
        err = json.loads(max(bundles, key=lambda p: p.stat().st_mtime).read_text()).get("error") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    return f": {err.get('type')}: {err.get('message')}"
