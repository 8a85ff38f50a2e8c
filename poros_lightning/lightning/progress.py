"""The progress bar of ``poros-lightning fit``: optimizer steps out of ``max_steps``, loss, tokens/s and memory.

Lightning's bar counts batches per epoch and titles it ``Epoch 0/-2`` when a run is bounded by ``max_steps``
(``max_epochs=-1``), and shows the logger's ``v_num``. This one counts optimizer steps across epochs when
``max_steps`` is set, and shows what a streamed run is judged by: loss, tokens/s, peak GPU memory, host RSS. It
reads counters only (no device synchronization, no RNG draw), so it never changes what a run computes.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import psutil
import torch
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

__all__ = ["PorosProgressBar"]

_GIB = 2**30
_RENAMED = {"train/loss": "loss", "train/tokens_per_s": "tok/s", "val/loss": "val_loss"}


class PorosProgressBar(RichProgressBar):
    """A :class:`~lightning.pytorch.callbacks.RichProgressBar` by optimizer steps, with loss, tokens/s and memory.

    Shows ``step N/max_steps`` when ``trainer.max_steps`` is set (else Lightning's epoch bar, titled without a
    negative epoch count), and the metrics ``loss``, ``tok/s``, ``val_loss`` (from the module's ``train/loss``,
    ``train/tokens_per_s``, ``val/loss``), any other ``prog_bar=True`` metric, ``gpu_peak`` (CUDA's peak allocated
    memory, on a GPU) and ``rss`` (this process's resident host memory). No ``v_num``.

    Args:
        kwargs: passed to ``RichProgressBar`` (``refresh_rate``, ``leave``, ``theme``, ``console_kwargs``).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._process = psutil.Process()

    def _by_steps(self, trainer: L.Trainer) -> bool:
        return trainer.max_steps is not None and trainer.max_steps > 0

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self._by_steps(self.trainer):
            description = "Training"
        elif self.trainer.max_epochs is not None and self.trainer.max_epochs > 0:
            description = f"Epoch {current_epoch}/{self.trainer.max_epochs - 1}"
        else:
            description = f"Epoch {current_epoch}"
        return f"{description:{len(self.validation_description)}}"

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._by_steps(trainer):
            super().on_train_epoch_start(trainer, pl_module)
            return
        # One task for the whole run, counting optimizer steps: epochs do not restart it.
        if not self.is_disabled and self.progress is not None and self.train_progress_bar_id is None:
            self.train_progress_bar_id = self._add_task(trainer.max_steps, self._get_train_description(0))
            self._update(self.train_progress_bar_id, trainer.global_step)
        self.refresh()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._by_steps(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if not self.is_disabled and self.train_progress_bar_id is None:
            self.on_train_epoch_start(trainer, pl_module)
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        shown: dict[str, Any] = {_RENAMED.get(key, key): value for key, value in items.items()}
        if isinstance(shown.get("tok/s"), float):
            shown["tok/s"] = f"{shown['tok/s']:.0f}"
        shown.update(self.memory(pl_module.device))
        return shown

    def memory(self, device: torch.device) -> dict[str, str]:
        """``gpu_peak`` (on CUDA: peak allocated since the last reset) and ``rss``, as text in GiB."""
        out = {}
        if device.type == "cuda":
            out["gpu_peak"] = f"{torch.cuda.max_memory_allocated(device) / _GIB:.2f} GiB"
        out["rss"] = f"{self._process.memory_info().rss / _GIB:.2f} GiB"
        return out
