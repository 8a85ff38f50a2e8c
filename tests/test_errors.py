"""Every bad input of docs/errors.md fails early with its error type and a HINT naming the fix."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_config

from poros_lightning import quant
from poros_lightning.arch import get_arch
from poros_lightning.engine import store
from poros_lightning.errors import (
    DataError,
    NonFiniteLossError,
    PorosConfigError,
    PorosError,
    PorosOOMError,
    UnsupportedArchitectureError,
)
from poros_lightning.lightning.checkpoint import PorosCheckpoint
from poros_lightning.lightning.strategy import PorosStrategy, nondeterminism
from poros_lightning.memory.planner import plan_engine
from poros_lightning.training.data import read_records
from poros_lightning.training.module import LoRALightningModule


def hint(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\nHINT: " in text, text
    return text.split("\nHINT: ", 1)[1]


@pytest.fixture(scope="module")
def module() -> LoRALightningModule:
    return LoRALightningModule(
        model_config=tiny_config(num_hidden_layers=1, max_position_embeddings=128), quantization="none", lora_r=4
    )


def test_unregistered_architecture() -> None:
    with pytest.raises(UnsupportedArchitectureError) as err:
        get_arch("not-a-model-type")
    assert isinstance(err.value, ValueError) and "allow_unlisted" in hint(err)


def test_block_that_cannot_fit_the_budget() -> None:
    with pytest.raises(PorosOOMError) as err:
        plan_engine(tiny_config(), "1KB", seq_len=64, lora_r=8)
    assert isinstance(err.value, MemoryError) and "vram_budget >=" in hint(err)


def test_seq_len_beyond_the_model_context(module: LoRALightningModule) -> None:
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(seq_len=4096, tokenizer=None))
    try:
        with pytest.raises(PorosConfigError, match="max_position_embeddings=128") as err:
            module.setup("fit")
    finally:
        module._trainer = None
    assert "data.seq_len to at most 128" in hint(err)


def test_empty_dataset(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no record") as err:
        read_records(tmp_path / "empty.jsonl")
    assert "add records" in hint(err)


def test_malformed_dataset(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"instruction": "hi", "output": "yo"}\n{"instruction": \n')
    with pytest.raises(DataError, match="bad.jsonl:2: invalid JSON") as err:
        read_records(tmp_path / "bad.jsonl")
    assert "one JSON object" in hint(err)


def test_lora_targets_that_match_nothing() -> None:
    with pytest.raises(PorosConfigError, match="target_modules") as err:
        LoRALightningModule(model_config=tiny_config(num_hidden_layers=1), quantization="none", target_modules=["nope"])
    assert "q_proj" in hint(err)  # names the model's linear layers


def test_non_deterministic_settings_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert nondeterminism(torch.device("cpu")) is None  # CPU kernels are deterministic
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    why = nondeterminism(torch.device("cuda", 0))
    assert why is not None and "use_deterministic_algorithms(True)" in why and "CUBLAS_WORKSPACE_CONFIG" in why
    assert "trainer.deterministic: true" in why
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert nondeterminism(torch.device("cuda", 0)) is None


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(module: LoRALightningModule, tmp_path: Path) -> None:
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    with pytest.raises(NonFiniteLossError, match="nan") as err:
        module.on_train_batch_end(torch.tensor(float("nan")), batch, 0)
    assert isinstance(err.value, FloatingPointError) and "learning_rate" in hint(err)
    callback = PorosCheckpoint(tmp_path, every_n_steps=1)
    callback.on_train_batch_end(None, module, {"loss": torch.tensor(float("inf"))}, batch, 0)  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())  # nothing written: the previous checkpoint stays the latest


def test_missing_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(PorosError, match="bitsandbytes is needed") as err:
        quant.bnb.__wrapped__()
    assert "pip install bitsandbytes" in hint(err)


def test_gpu_run_on_a_cpu_only_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PorosConfigError, match="asks for a GPU") as err:
        PorosStrategy(device="cuda")
    assert "CUDA build of torch" in hint(err) and "device='cpu'" in hint(err)


def test_pinned_memory_that_cannot_be_allocated(monkeypatch: pytest.MonkeyPatch, caplog) -> None:  # noqa: ANN001
    # Not an error: the block is copied from pageable memory (same bytes, slower), with a warning naming the fix.
    monkeypatch.setattr(store, "_cuda_pin", lambda arena: False)
    linear = torch.nn.Linear(8, 8)
    host = store.HostStore([store.Layout.of([(linear, "weight")])], pin_memory=True)
    host.pin_memory = True  # as on a CUDA machine (the store only pins when CUDA is available)
    with caplog.at_level(logging.WARNING, logger=store.__name__):
        host.fill(0)
    assert not host.pinned
    assert "Could not page-lock" in caplog.text and "ulimit -l" in caplog.text
