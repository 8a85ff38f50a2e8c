"""The progress bar counts optimizer steps out of max_steps across epochs and shows loss, tokens/s and memory."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from poros_lightning._logging import log_count
from poros_lightning.lightning.progress import PorosProgressBar


class _Logged(BoringModel):
    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"], prog_bar=True)
        self.log("train/tokens_per_s", 1234.5, prog_bar=True)
        return out


def _fit(tmp_path: Path, **trainer_kwargs: object) -> PorosProgressBar:
    bar = PorosProgressBar()
    trainer = L.Trainer(
        accelerator="cpu",
        callbacks=[bar],
        logger=CSVLogger(tmp_path),  # a logger: Lightning's bar would show its v_num
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
        **trainer_kwargs,
    )
    trainer.fit(_Logged())
    return bar


def test_the_bar_counts_steps_across_epochs(tmp_path: Path) -> None:
    bar = _fit(tmp_path, max_steps=5, limit_train_batches=2)  # 3 epochs of 2 batches
    (task,) = [t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id]
    assert task.total == 5 and task.completed == 5
    assert task.description.strip() == "Training"  # not "Epoch 2/-2"
    shown = bar.get_metrics(bar.trainer, bar.trainer.lightning_module)
    assert "v_num" not in shown and "train/loss" not in shown
    assert isinstance(shown["loss"], float) and shown["tok/s"] == "1234" and shown["rss"].endswith(" GiB")
    assert ("gpu_peak" in shown) == torch.cuda.is_available()


def test_an_epoch_bound_run_keeps_the_epoch_bar(tmp_path: Path) -> None:
    bar = _fit(tmp_path, max_epochs=2, limit_train_batches=3)
    (task,) = [t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id]
    assert task.total == 3 and task.description.strip() == "Epoch 1/1"


def test_long_phases_log_counts_at_each_tenth(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("poros_lightning.test")
    with caplog.at_level(logging.INFO, logger="poros_lightning"):
        for done in range(1, 21):
            log_count(log, "pinning", done, 20, start=0.0)
        for done in range(1, 5):
            log_count(log, "tiny phase", done, 4, start=0.0)  # too short to report
    counts = [r.getMessage().split(" (")[0] for r in caplog.records]
    assert counts == [f"pinning {n}/20" for n in range(2, 21, 2)]
