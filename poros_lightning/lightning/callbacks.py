"""Callbacks usable with any LightningModule: system metrics, and the PEFT adapter written at the end of a fit.

``SystemMetrics`` reads counters only (no device synchronization, no RNG draw), so adding it never changes
what a run computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import psutil
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from poros_lightning.errors import PorosError

__all__ = ["SaveAdapter", "SystemMetrics", "find_peft_model"]

_GIB = 2**30


class SystemMetrics(L.Callback):
    """Log peak GPU memory and host resident memory.

    Logged keys: ``system/host_rss_gib`` (resident set size of this process) and, on CUDA,
    ``system/peak_gpu_mem_gib`` (``torch.cuda.max_memory_allocated`` since the start of the fit or since
    the last reset). Both are logged every ``log_every_n_steps`` training batches and at the end of each
    validation epoch.

    Args:
        log_every_n_steps: how often to log during training.
        reset_peak_at_fit_start: reset CUDA's peak-memory counter when the fit starts, so the peak
            reflects training rather than model loading.
    """

    def __init__(self, log_every_n_steps: int = 1, reset_peak_at_fit_start: bool = True) -> None:
        if log_every_n_steps < 1:
            raise PorosError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}.", "Use 1 to log every step.")
        self.log_every_n_steps = log_every_n_steps
        self.reset_peak_at_fit_start = reset_peak_at_fit_start
        self._process = psutil.Process()

    def metrics(self, device: torch.device | None = None) -> dict[str, float]:
        """Return the current memory figures in GiB."""
        out = {"system/host_rss_gib": self._process.memory_info().rss / _GIB}
        if device is not None and device.type == "cuda":
            out["system/peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
        return out

    def _log(self, pl_module: L.LightningModule) -> None:
        for key, value in self.metrics(pl_module.device).items():
            pl_module.log(key, value, on_step=pl_module.trainer.training, on_epoch=not pl_module.trainer.training)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.reset_peak_at_fit_start and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % self.log_every_n_steps == 0:
            self._log(pl_module)

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._log(pl_module)


def find_peft_model(module: torch.nn.Module) -> Any:
    """Return the first PEFT ``PeftModel`` inside ``module`` (itself included).

    Raises:
        PorosError: ``module`` holds no ``PeftModel``.
    """
    from peft import PeftModel

    for sub in module.modules():
        if isinstance(sub, PeftModel):
            return sub
    raise PorosError(
        f"{type(module).__name__} holds no PEFT model, so there is no adapter to save.",
        "Wrap the base with peft.get_peft_model(...) and keep it as an attribute of the LightningModule.",
    )


class SaveAdapter(L.Callback):
    """Write the PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) after a fit.

    The adapter is saved in ``on_fit_end``, which Lightning calls only after a fit that finished and after
    the strategy's teardown, so the model is back in its plain PEFT form. Only global rank zero writes.

    Args:
        dirpath: directory to write; created if needed, files inside are overwritten.
    """

    def __init__(self, dirpath: str | Path) -> None:
        self.dirpath = Path(dirpath)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        peft_model = find_peft_model(pl_module)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        from poros_lightning.training.adapter import save_adapter

        save_adapter(peft_model, self.dirpath)  # PEFT directory + poros_training.json (how the base was quantized)
        rank_zero_info(f"Adapter saved to {self.dirpath}")
