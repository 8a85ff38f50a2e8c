"""Build identical random-init PEFT QLoRA models for both arms of a gate or a benchmark.

Invariant: two calls with the same arguments return models with identical bytes (base, quantized
base and LoRA init): everything is seeded here, right before each draw, and quantization runs on
the compute device. No engine code is used: the reference arm stays independent of the engine.

Note: [block-by-block build]
    A model whose bf16 weights do not fit on the device (Qwen2.5-72B is 145 GB in bf16; an H200 has
    139 GB) is built by the loader instead: :func:`~poros_lightning.quant.loader.load_random_quantized`
    draws each tensor from its own seed and quantizes it on the device one tensor at a time, so the
    device never holds more than one bf16 matrix beside the NF4 base. The quantized model then moves to
    the device whole: the reference arm is a resident model, as with the direct build.
"""

from __future__ import annotations

from typing import Any

import torch

from poros_lightning.quant import quantize_model
from poros_lightning.quant.hf_config import build_from_config, checkpoint_auto_class, hf_config

__all__ = ["bf16_bytes", "build_peft_model", "lora_targets_for"]


def lora_targets_for(model_type: str) -> list[str]:
    """Default LoRA targets of a registered family (all linear layers of the decoder)."""
    from poros_lightning.arch import get_arch

    return list(get_arch(model_type).lora_targets)


def bf16_bytes(config: dict[str, Any]) -> int:
    """Bytes of the model's weights in bf16, counted on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = build_from_config(checkpoint_auto_class(config["model_type"]), hf_config(config), dtype=torch.bfloat16)
    return sum(t.numel() * 2 for t in {id(p): p for p in model.parameters()}.values())


def _blockwise(device: torch.device | str, blockwise: bool | None, config: dict[str, Any]) -> bool:
    """Build through the loader when asked, or (``None``) when the bf16 model would not fit on the device."""
    if blockwise is not None:
        return blockwise
    device = torch.device(device)
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return bf16_bytes(config) > 0.8 * free


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
    blockwise: bool | None = None,
) -> torch.nn.Module:
    """A random-init HF causal LM from ``config``, quantized on ``device``, wrapped with PEFT LoRA.

    The model is the class the family's checkpoints load as (``...ForConditionalGeneration`` for the multimodal
    families, :func:`~poros_lightning.quant.hf_config.checkpoint_auto_class`).

    Args:
        config: HF config dict including ``model_type``; the text decoder's keys flat or under ``text_config``,
            missing keys at the transformers defaults.
        device: where the weights are created and quantized (the GPU for large models).
        quantization: see :data:`poros_lightning.quant.QUANTIZATIONS`.
        lora_r: LoRA rank; ``lora_alpha`` defaults to ``2 * lora_r``.
        lora_dropout: LoRA dropout probability.
        target_modules: LoRA targets; the family's default (all linear layers) when ``None``.
        seed: seeds the base init and, separately, the LoRA init.
        attn_implementation: attention kernel (``"sdpa"`` or ``"eager"``).
        blockwise: build tensor by tensor through the loader (Note: [block-by-block build]); ``None``
            does so when the bf16 model would take more than 80% of the free device memory. The two
            builds draw different random weights; each is deterministic.
    """
    from peft import LoraConfig, get_peft_model

    model_type = config["model_type"]
    auto_class = checkpoint_auto_class(model_type)
    if _blockwise(device, blockwise, config):
        from poros_lightning.quant.loader import load_random_quantized

        model = load_random_quantized(
            config,
            seed=seed,
            quantization=quantization,
            compute_device=device,
            progress=False,
            attn_implementation=attn_implementation,
            auto_class=auto_class,
        )
        model.to(device)
        model.train()
    else:
        hf = hf_config(config)
        hf._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        with torch.device(device):
            model = build_from_config(auto_class, hf, dtype=torch.bfloat16)
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
