"""Shared fixtures: tiny in-process models, so tests run in seconds on 2 CPU cores."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_config(model_type: str = "qwen2", **overrides: object) -> dict:
    """A tiny config dict of ``model_type`` (4 layers, hidden 64)."""
    cfg = {
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    cfg.update(overrides)
    return cfg


def build_peft_model(
    cfg: dict | None = None,
    *,
    lora_dropout: float = 0.1,
    quantization: str = "nf4-dq",
    seed: int = 0,
    r: int = 8,
    targets: list[str] | None = None,
) -> torch.nn.Module:
    """Plain transformers + PEFT (+ bitsandbytes through quantize_model): no engine code."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from poros_lightning.quant import quantize_model

    cfg = dict(cfg or tiny_config())
    model_type = cfg.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.bfloat16)
    quantize_model(model, quantization)
    torch.manual_seed(seed + 1)  # LoRA init draws from the RNG: seed right before get_peft_model
    lora = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=lora_dropout, target_modules=targets or ALL_LINEAR)
    model = get_peft_model(model, lora)
    model.train()
    return model


def train_loop(model: torch.nn.Module, steps: int = 3, accumulate: int = 1, vocab: int = 256) -> dict:
    """A plain loop; returns per-step losses and grads, final adapter and optimizer state."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(123)
    losses, grads = [], []
    for _ in range(steps):
        for _ in range(accumulate):
            ids = torch.randint(0, vocab, (2, 16), generator=gen)
            logits = model(input_ids=ids, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
            (loss / accumulate).backward()
            losses.append(loss.detach())
        grads.append([p.grad.clone() for p in params])
        opt.step()
        opt.zero_grad()
    state = [t for s in opt.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)]
    return {
        "loss": losses,
        "grads": grads,
        "adapter": dict(zip(names, [p.detach().clone() for p in params], strict=False)),
        "optim": state,
    }


def differences(ref: dict, got: dict) -> dict[str, int]:
    return {
        "loss": sum(not torch.equal(a, b) for a, b in zip(ref["loss"], got["loss"], strict=True)),
        "grads": sum(
            not torch.equal(a, b)
            for sa, sb in zip(ref["grads"], got["grads"], strict=True)
            for a, b in zip(sa, sb, strict=False)
        ),
        "adapter": sum(not torch.equal(ref["adapter"][k], got["adapter"][k]) for k in ref["adapter"]),
        "optim": sum(not torch.equal(a, b) for a, b in zip(ref["optim"], got["optim"], strict=True)),
    }


@pytest.fixture
def tiny_cfg() -> dict:
    return tiny_config()


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_configure(config: pytest.Config) -> None:
    # pytest resets the warning filters around each test, dropping those `import poros_lightning` installed
    # (poros_lightning._quiet): give it the same ones, so tests see what a user sees.
    import re

    from poros_lightning import _quiet

    for message, category in _quiet.WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:{re.escape(message)}:{category.__name__}")


pytest_plugins = ["results_jsonl"]  # --results-jsonl PATH: the raw record of a run, a row per test
