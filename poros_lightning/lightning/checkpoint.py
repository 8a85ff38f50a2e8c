"""Atomic, pickle-free training checkpoints and an exact mid-epoch resume.

Invariant: a run resumed from ``step-N`` computes exactly what the uninterrupted run computed after step
``N``: the adapter, the optimizer and scheduler state, every RNG stream (Python, NumPy, torch CPU and CUDA),
the loop counters and the position in the data order are restored, so the final adapter and optimizer state
are ``torch.equal`` to the uninterrupted run's.

A checkpoint is a directory ``<dirpath>/step-<N>/`` of safetensors and JSON files only, so loading one never
runs code. It is written into ``step-<N>.tmp/`` (every file and the directory fsync'ed), then renamed; the
``latest`` pointer file is replaced atomically afterwards. A crash at any moment leaves the previous
checkpoint whole, and :func:`load_latest` skips an incomplete or corrupt one with a warning.

The data position is kept by :class:`~poros_lightning.training.resumable.ResumableDataLoader` (Note: [data
position] there).

Note: [end of training] The checkpoint written when training ends holds the loop counters, the data position
and the RNG states as they were right after the last optimizer step, as a periodic checkpoint of that step
would. By ``on_train_end`` Lightning has marked the interrupted epoch finished (a run stopped by ``max_steps``
or ``max_time`` mid-epoch would resume at the next epoch), and batches accumulated after the last step have
drawn dropout masks.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from poros_lightning.errors import PorosConfigError, ResumeMismatchError
from poros_lightning.lightning.checkpoint_files import (
    Checkpoint,
    load_checkpoint,
    load_latest,
    no_checkpoint,
    resume_source,
    write_checkpoint,
)

__all__ = [
    "Checkpoint",
    "PorosCheckpoint",
    "load_checkpoint",
    "load_latest",
    "resume_source",
]


# ------------------------------------------------------------------------------------------------ state


def _jsonable(obj: Any, where: str) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, where) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, where) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise PorosConfigError(
        f"{where} holds a {type(obj).__name__}, which a safetensors/JSON checkpoint cannot store.",
        "Use an optimizer and lr scheduler whose state_dict holds only tensors, numbers and strings.",
    )


def _optimizer_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": _jsonable(state["param_groups"], "The optimizer"), "state": scalars}


def _optimizer_state(ckpt: Checkpoint, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in ckpt.optimizer_tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = tensor
    for index, entry in ckpt.optimizer["state"].items():
        state.setdefault(int(index), {}).update(entry)
    groups = ckpt.optimizer["param_groups"]
    for saved, current in zip(groups, optimizer.param_groups, strict=False):
        for key, value in current.items():  # JSON has no tuples (AdamW's betas)
            if isinstance(value, tuple) and key in saved:
                saved[key] = tuple(saved[key])
    return {"state": state, "param_groups": groups}


def _rng_files() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors.update({f"torch.cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    except ImportError:  # numpy is optional
        pass
    return tensors, out


def _restore_rng(ckpt: Checkpoint) -> None:
    torch.set_rng_state(ckpt.rng_tensors["torch.cpu"])
    cuda = [ckpt.rng_tensors[k] for k in sorted(ckpt.rng_tensors) if k.startswith("torch.cuda.")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = ckpt.rng["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in ckpt.rng:
        import numpy as np

        kind, keys, pos, has_gauss, cached = ckpt.rng["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("poros-lightning", "torch", "lightning", "peft", "transformers", "bitsandbytes"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            continue
    return out


def run_identity(trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
    """What a checkpoint must share with the run resuming from it for the resume to be exact.

    ``exact`` (the base model's config hash, quantization and compute dtype, precision, gradient accumulation,
    batch size and data seed) and ``adapter`` (every trainable tensor's name and shape) must match; ``engine``
    (streaming layout) and ``versions`` are recorded for information: the engine computes the same bits
    whatever its layout.
    """
    import hashlib

    from poros_lightning.api import options_of
    from poros_lightning.lightning.precision import find_peft_models

    models = find_peft_models(module)
    configs = []
    for peft_model in models:
        config = peft_model.get_base_model().config.to_dict()
        for volatile in ("_name_or_path", "transformers_version"):
            config.pop(volatile, None)
        configs.append(config)
    digest = hashlib.sha256(json.dumps(configs, sort_keys=True, default=str).encode()).hexdigest()
    hparams = getattr(module, "hparams", {})
    data = trainer.datamodule
    exact = {
        "model_config_sha256": digest,
        "model": hparams.get("model"),
        "quantization": getattr(trainer.strategy, "quantization", hparams.get("quantization")),
        "compute_dtype": hparams.get("compute_dtype"),
        "precision": str(trainer.precision),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "batch_size": getattr(data, "batch_size", None),
        "data_seed": getattr(data, "seed", None),
        "micro_batches": getattr(trainer.strategy, "micro_batches", 1),
        "compile_layers": bool(hparams.get("compile_layers", False)),
    }
    engine = dict(getattr(trainer.strategy, "engine_kwargs", {}))  # recorded for information only
    for peft_model in models:
        engine.update({k: str(v) for k, v in options_of(peft_model).items()})
    adapter = {name: list(p.shape) for name, p in module.named_parameters() if p.requires_grad}
    plans = [json.loads(json.dumps(m._poros_plan, default=str)) for m in models if getattr(m, "_poros_plan", None)]
    identity = {"exact": exact, "adapter": adapter, "engine": _jsonable(engine, "engine"), "versions": _versions()}
    return {**identity, "plan": plans} if plans else identity


_ADDED_LATER = {"micro_batches": 1, "compile_layers": False}  # what checkpoints written before these keys ran with


def check_identity(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Refuse a resume that would not be exact, naming every difference.

    Raises:
        ResumeMismatchError: the model, the adapter or an option that changes the computed bits differs.
    """
    diffs = [
        f"{key}: checkpoint {saved['exact'].get(key)!r}, this run {value!r}"
        for key, value in current["exact"].items()
        if saved["exact"].get(key, _ADDED_LATER.get(key)) != value
    ]
    old, new = saved["adapter"], current["adapter"]
    if old != new:
        names = sorted(set(old) ^ set(new)) or sorted(k for k in old if old[k] != new[k])
        diffs.append(f"adapter tensors differ ({len(old)} saved, {len(new)} now; e.g. {names[:2]})")
    if diffs:
        raise ResumeMismatchError(
            f"Checkpoint {path} was written by a different run: " + "; ".join(diffs) + ".",
            "Resume with the config the checkpoint was trained with (model, lora_r, target_modules, quantization, "
            "precision, batch size, seed), or start a fresh run with another checkpoint dirpath.",
        )
    if saved.get("versions") != current.get("versions"):
        warnings.warn(
            f"Checkpoint {path} was written with {saved.get('versions')}, this run uses {current.get('versions')}; "
            "a kernel change between versions can break bit-exactness.",
            stacklevel=2,
        )


# ------------------------------------------------------------------------------------------------ callback


class PorosCheckpoint(L.Callback):
    """Write atomic safetensors/JSON checkpoints every ``every_n_steps`` optimizer steps and resume exactly.

    Each checkpoint holds the adapter, the optimizer and lr-scheduler state, every RNG state, the loop
    counters and the data position, and the run identity (see :func:`run_identity`). A step whose loss is
    not finite is never checkpointed, so after a ``NonFiniteLossError`` the last checkpoint is the last good one.

    Exact mid-epoch resume needs the training loader to be a :class:`ResumableDataLoader`
    (``InstructionDataModule``'s is); with another loader the resumed epoch restarts its data, with a warning.

    Args:
        dirpath: checkpoint directory.
        every_n_steps: optimizer steps between checkpoints (one is also written when training ends).
        keep_last: checkpoints kept (older ones are deleted once a new one is complete).
        resume: ``True``: resume from the newest loadable checkpoint in ``dirpath`` when there is one (else
            start fresh); a path: resume from the newest checkpoint under that directory (it must have one).
    """

    def __init__(
        self,
        dirpath: str | Path = "checkpoints",
        every_n_steps: int = 100,
        keep_last: int = 2,
        resume: bool | str = False,
    ) -> None:
        if every_n_steps < 1 or keep_last < 1:
            raise PorosConfigError(
                f"every_n_steps={every_n_steps} and keep_last={keep_last} must both be >= 1.",
                "Set PorosCheckpoint(every_n_steps=N, keep_last=K) with N, K >= 1.",
            )
        self.dirpath, self.every_n_steps, self.keep_last, self.resume = Path(dirpath), every_n_steps, keep_last, resume
        self.resumed_from: Checkpoint | None = None
        self._last_saved = -1
        self._after_step: dict[str, Any] | None = None  # see Note: [end of training]

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        source = resume_source(self.resume, self.dirpath)
        if source is None:
            return
        ckpt = load_latest(source)
        if ckpt is None:  # every checkpoint there is incomplete or corrupt (load_latest warned about each)
            if self.resume is True:
                return
            raise no_checkpoint(source)
        check_identity(ckpt.meta["identity"], run_identity(trainer, pl_module), ckpt.path)
        with torch.no_grad():
            for name, p in pl_module.named_parameters():
                if p.requires_grad:
                    p.copy_(ckpt.adapter[name])
        for index, optimizer in enumerate(trainer.optimizers):
            if index > 0:
                raise PorosConfigError("PorosCheckpoint supports one optimizer.", "Return one optimizer.")
            optimizer.load_state_dict(_optimizer_state(ckpt, optimizer))
        for config, state in zip(trainer.lr_scheduler_configs, ckpt.schedulers, strict=True):
            config.scheduler.load_state_dict(state)
        # Lightning's own restore path: the loop counters, and the data position handed to the loader.
        trainer.fit_loop.load_state_dict(ckpt.meta["fit_loop"])
        self.resumed_from, self._last_saved = ckpt, ckpt.step

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.resumed_from is not None:
            _restore_rng(self.resumed_from)  # last: nothing between here and the first batch draws
        self._after_step = _progress(trainer)  # the state "after" the step this fit starts from

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None and not bool(torch.isfinite(loss)):
            return  # the module stops the run; the previous checkpoint stays the latest
        step = trainer.global_step
        if self._after_step is None or self._after_step["global_step"] != step:  # this batch ended with a step
            self._after_step = _progress(trainer)  # a few counters and the RNG states: cheap every step
        if step > self._last_saved and step % self.every_n_steps == 0:
            self.save(trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step > self._last_saved:
            self.save(trainer, pl_module)

    def save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Path | None:
        """Write a checkpoint of the state after the last optimizer step (global rank zero only).

        Returns:
            The checkpoint directory, or ``None`` where nothing was written (another rank, a non-finite adapter).
        """
        step = trainer.global_step
        self._last_saved = step
        adapter = {name: p for name, p in pl_module.named_parameters() if p.requires_grad}
        if not all(bool(torch.isfinite(p).all()) for p in adapter.values()):
            warnings.warn(f"The adapter is not finite at step {step}: no checkpoint written.", stacklevel=2)
            return None
        if not trainer.is_global_zero:
            return None
        if len(trainer.optimizers) != 1:
            raise PorosConfigError("PorosCheckpoint supports one optimizer.", "Return one optimizer.")
        opt_tensors, opt_json = _optimizer_files(trainer.optimizers[0])
        after = self._after_step  # see Note: [end of training]
        progress = after if after is not None and after["global_step"] == step else _progress(trainer)
        meta = {
            "format": 1,
            **{key: progress[key] for key in ("global_step", "epoch", "batches_in_epoch", "fit_loop")},
            "identity": run_identity(trainer, pl_module),
        }
        schedulers = [_jsonable(c.scheduler.state_dict(), "The lr scheduler") for c in trainer.lr_scheduler_configs]
        files = {
            "adapter.safetensors": adapter,
            "optimizer.safetensors": opt_tensors,
            "optimizer.json": opt_json,
            "scheduler.json": {"schedulers": schedulers},
            "rng.safetensors": progress["rng_tensors"],
            "rng.json": progress["rng"],
            "meta.json": meta,
        }
        return write_checkpoint(self.dirpath, step, files, self.keep_last)


def _progress(trainer: L.Trainer) -> dict[str, Any]:
    """The loop counters, the data position and every RNG state, as they are now."""
    fit_loop = trainer.fit_loop.state_dict()
    processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    for state in fit_loop["state_dict"].get("combined_loader", []):
        state["batches"] = processed  # the loop's count, not the loader's: the fetcher reads ahead
    rng_tensors, rng = _rng_files()
    return {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "batches_in_epoch": processed,
        "fit_loop": _jsonable(fit_loop, "The fit loop state"),
        "rng_tensors": rng_tensors,
        "rng": rng,
    }
