"""CPU parity for every registered family: streamed == resident on loss, grads, adapter, optimizer.

Each family is built tiny from its config (random init, NF4 base, LoRA on the family's default
targets inside the decoder layers), then trained a few steps resident and streamed with more blocks
than slots. Gemma 3/4 configs alternate sliding-window and full-attention layers with a window
shorter than the sequence, so the per-layer-type masks and rotary tables pass through the engine.
"""

from __future__ import annotations

import pytest
import torch
from conftest import differences, train_loop
from test_arch import TINY

from poros_lightning import prepare
from poros_lightning.arch import get_arch
from poros_lightning.quant import quantize_model

VOCAB = 300


def _config(model_type: str) -> dict:
    cfg = dict(TINY[model_type])
    text = cfg.get("text_config", cfg)
    if model_type.startswith("gemma"):
        text.update(sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)
    if "vocab_size_per_layer_input" in text:
        text["vocab_size_per_layer_input"] = VOCAB  # per-layer inputs are looked up by token id
    return cfg


def _build(model_type: str) -> torch.nn.Module:
    import transformers
    from peft import LoraConfig, get_peft_model

    cfg = _config(model_type)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    if model_type == "qwen3_5":  # AutoModelForCausalLM would build the text model only
        model = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    quantize_model(model)
    torch.manual_seed(1)
    spec = get_arch(model_type)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=spec.peft_target_modules())
    model = get_peft_model(model, lora)
    model.train()
    return model


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_family_streamed_equals_resident(model_type: str) -> None:
    ref = train_loop(_build(model_type), steps=2, vocab=VOCAB)
    model = prepare(_build(model_type), device="cpu", block_size=1)
    got = train_loop(model, steps=2, vocab=VOCAB)
    assert differences(ref, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_5_text", "llama"])
def test_family_kept_activations_equal_resident(model_type: str) -> None:
    """Every layer keeps its activations (no recompute): per-layer-type masks and linear attention too."""
    ref = train_loop(_build(model_type), steps=2, vocab=VOCAB)
    model = prepare(_build(model_type), device="cpu", block_size=1, keep_activations=100)
    got = train_loop(model, steps=2, vocab=VOCAB)
    assert differences(ref, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}
