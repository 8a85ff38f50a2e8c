"""LoRALightningModule on a tiny NF4 Qwen2: training helps, only the adapter trains and is checkpointed."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from poros_lightning.errors import NonFiniteLossError, PorosConfigError, PorosError, ResumeMismatchError
from poros_lightning.lightning.callbacks import SaveAdapter, SystemMetrics, find_peft_model
from poros_lightning.quant import is_4bit_linear
from poros_lightning.training.module import LoRALightningModule, causal_lm_loss

VOCAB = 512
TINY_QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
}


def make_module(**kwargs: object) -> LoRALightningModule:
    defaults = {"model_config": TINY_QWEN2, "lora_r": 8, "learning_rate": 1e-2, "seed": 0}
    return LoRALightningModule(**{**defaults, **kwargs})


def random_batches(n: int = 8, seq: int = 32, batch_size: int = 4) -> DataLoader:
    """Fixed random token rows; the last 4 positions of odd rows are padding (masked, no loss)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[1::2, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]
    return DataLoader(rows, batch_size=batch_size)


def trainer(tmp_path, max_steps: int = 20, **kwargs: object) -> L.Trainer:
    defaults = {
        "max_steps": max_steps,
        "accelerator": "cpu",
        "default_root_dir": tmp_path,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
    }
    return L.Trainer(**{**defaults, **kwargs})


def adapter_tensors(module: LoRALightningModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def test_causal_lm_loss_shifts_and_masks() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.bfloat16)
    labels = torch.tensor([[1, 2, 3, -100, -100], [-100, 4, 5, 6, 0]])
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, 7), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    assert torch.allclose(causal_lm_loss(logits, labels), expected)
    assert causal_lm_loss(logits, labels).dtype == torch.float32
    # No labelled position: zero loss (not NaN) that still backpropagates.
    empty = logits.float().requires_grad_()
    loss = causal_lm_loss(empty, torch.full((2, 5), -100))
    loss.backward()
    assert loss.item() == 0.0 and empty.grad is not None


def test_build_applies_lora_to_every_decoder_linear() -> None:
    module = make_module()
    assert module.model.training
    lora_a = [n for n, _ in module.model.named_parameters() if "lora_A" in n]
    assert len(lora_a) == 2 * 7
    assert all(".lora_" in n for n, p in module.named_parameters() if p.requires_grad)
    base4 = [m for m in module.modules() if is_4bit_linear(m)]
    assert len(base4) == 2 * 7 and all(m.support_avx512bf16_for_cpu is False for m in base4)


def test_seed_makes_lora_init_reproducible() -> None:
    a, b, c = make_module(seed=7), make_module(seed=7), make_module(seed=8)
    ta, tb, tc = adapter_tensors(a), adapter_tensors(b), adapter_tensors(c)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert any(not torch.equal(ta[k], tc[k]) for k in ta)


def test_fit_reduces_loss_and_changes_every_lora_tensor(tmp_path) -> None:
    module = make_module(lora_dropout=0.0)
    data = random_batches()
    before = adapter_tensors(module)
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    t = trainer(tmp_path, max_steps=20, callbacks=[SystemMetrics()])
    # Validate first: an eval-mode no-grad forward must not break training afterwards (bitsandbytes repacking).
    loss_before = t.validate(module, data, verbose=False)[0]["val/loss"]
    t.fit(module, data, data)
    metrics = {k: float(v) for k, v in t.callback_metrics.items()}
    loss_after = t.validate(module, data, verbose=False)[0]["val/loss"]

    assert loss_after < loss_before - 0.5, (loss_before, loss_after)
    after = adapter_tensors(module)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged
    assert all(torch.equal(p, frozen[n]) for n, p in module.named_parameters() if not p.requires_grad)
    for key in ("train/loss", "train/tokens_per_s", "train/lr", "val/loss", "val/ppl", "val/token_acc"):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-5)
    assert 0.0 <= metrics["val/token_acc"] <= 1.0 and metrics["train/tokens_per_s"] > 0
    assert metrics["system/host_rss_gib"] > 0


def test_warmup_scales_the_learning_rate(tmp_path) -> None:
    module = make_module(learning_rate=1e-3, warmup_steps=4)
    seen: list[float] = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer(tmp_path, max_steps=5, callbacks=[Record()]).fit(module, random_batches())
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    optimizer = module.configure_optimizers()["optimizer"]
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for p in module.parameters() if p.requires_grad
    )


def test_checkpoint_holds_only_the_adapter_and_restores_it(tmp_path) -> None:
    module = make_module()
    t = trainer(tmp_path, max_steps=3)
    t.fit(module, random_batches())
    path = tmp_path / "adapter.ckpt"
    t.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    trained = adapter_tensors(module)
    assert set(state) == set(trained)
    assert all(".lora_A." in k or ".lora_B." in k for k in state)

    restored = LoRALightningModule.load_from_checkpoint(path)
    assert all(torch.equal(p, trained[n]) for n, p in restored.named_parameters() if p.requires_grad)

    fresh = make_module(seed=1)
    fresh.load_state_dict(state)  # strict: every adapter tensor present, base tensors not expected
    assert all(torch.equal(p, trained[n]) for n, p in fresh.named_parameters() if p.requires_grad)
    with pytest.raises(ResumeMismatchError, match="missing"):
        fresh.load_state_dict(dict(list(state.items())[1:]))

    other = make_module(target_modules=["q_proj", "v_proj"])
    with pytest.raises(ResumeMismatchError, match="missing|unknown"):
        other.on_load_checkpoint(torch.load(path, weights_only=False))


def test_save_adapter_writes_a_peft_directory(tmp_path) -> None:
    module = make_module()
    trainer(tmp_path, max_steps=2, callbacks=[SaveAdapter(tmp_path / "cb")]).fit(module, random_batches())
    module.save_adapter(str(tmp_path / "direct"))
    n_lora = len(adapter_tensors(module))
    for out in ("cb", "direct"):
        config = json.loads((tmp_path / out / "adapter_config.json").read_text())
        assert config["r"] == 8 and config["peft_type"] == "LORA"
        assert len(load_file(tmp_path / out / "adapter_model.safetensors")) == n_lora
    assert find_peft_model(module) is module.model
    with pytest.raises(PorosError, match="holds no PEFT model"):
        find_peft_model(torch.nn.Linear(2, 2))


def test_tokenizer_larger_than_the_vocabulary_is_rejected_at_setup(tmp_path) -> None:
    module = make_module()

    class Data(L.LightningDataModule):
        tokenizer = list(range(VOCAB + 1))  # len() is all the check needs

        def train_dataloader(self) -> DataLoader:
            return random_batches()

    with pytest.raises(PorosConfigError, match="tokenizer has 513 tokens"):
        trainer(tmp_path, max_steps=1).fit(module, datamodule=Data())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lora_r": 0}, "lora_r must be a positive integer"),
        ({"lora_dropout": 1.0}, "lora_dropout must be in"),
        ({"learning_rate": -1.0}, "learning_rate must be > 0"),
        ({"target_modules": ["no_such_proj"]}, "target_modules .* do not match"),
    ],
)
def test_bad_arguments_raise_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(PorosConfigError, match=match):
        make_module(**kwargs)


def test_non_finite_loss_stops_training_with_a_hint(tmp_path, monkeypatch) -> None:
    module = make_module()
    monkeypatch.setattr(
        module, "training_step", lambda batch, batch_idx: torch.tensor(float("nan"), requires_grad=True)
    )
    with pytest.raises(NonFiniteLossError, match="HINT: Lower model.learning_rate"):
        trainer(tmp_path, max_steps=2).fit(module, random_batches())


def test_compiled_layers_stream_bit_identically(tmp_path) -> None:
    """compile_layers=True: each decoder layer compiled; streamed training equals resident, dropout masks too."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    adapters = {}
    for name, strategy in (("resident", SingleDeviceStrategy("cpu")), ("poros", "poros")):
        module = make_module(compile_layers=True, lora_dropout=0.1)
        layers = module.model.get_base_model().model.layers
        assert all(getattr(layer, "_poros_compiled", False) for layer in layers)
        trainer(tmp_path, max_steps=2, strategy=strategy).fit(module, random_batches(n=4))
        adapters[name] = adapter_tensors(module)
    assert adapters["resident"].keys() == adapters["poros"].keys()
    assert all(torch.equal(adapters["resident"][k], adapters["poros"][k]) for k in adapters["resident"])
