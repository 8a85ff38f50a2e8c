"""Build identical random-init PEFT QLoRA models for both arms of a gate or a benchmark.

Invariant: two calls with the same arguments return models with identical bytes (base, quantized
base and LoRA init): everything is seeded here, right before each draw, and quantization runs on
the compute device. No engine code is used: the reference arm stays independent of the engine.
"""

from __future__ import annotations

from typing import Any

import torch

from poros_lightning.quant import quantize_model

__all__ = ["build_peft_model", "lora_targets_for"]


def lora_targets_for(model_type: str) -> list[str]:
    """Default LoRA targets of a registered family (all linear layers of the decoder)."""
    from poros_lightning.arch import get_arch

    return list(get_arch(model_type).lora_targets)


def build_peft_model(
    config: dict[str, Any],
    *,
    device: torch.device | str = "cpu",
    quantization: str = "nf4-dq",
    lora_r: int = 16,
    lora_alpha: int | None = None,
    lora_dropout: float = 0.0,
    target_modules: list[str] | None = None,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A random-init HF causal LM from ``config``, quantized on ``device``, wrapped with PEFT LoRA.

    Args:
        config: HF config dict including ``model_type``.
        device: where the weights are created and quantized (the GPU for large models).
        quantization: see :data:`poros_lightning.quant.QUANTIZATIONS`.
        lora_r: LoRA rank; ``lora_alpha`` defaults to ``2 * lora_r``.
        lora_dropout: LoRA dropout probability.
        target_modules: LoRA targets; the family's default (all linear layers) when ``None``.
        seed: seeds the base init and, separately, the LoRA init.
        attn_implementation: attention kernel (``"sdpa"`` or ``"eager"``).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    hf_config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    quantize_model(model, quantization)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(seed + 1)  # LoRA init draws from the RNG
    lora = LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha if lora_alpha is not None else 2 * lora_r,
        lora_dropout=lora_dropout,
        target_modules=target_modules or lora_targets_for(model_type),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    model.train()
    return model
