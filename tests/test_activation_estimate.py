"""The planner's kept-activation estimate against what a decoder layer really saves, for every registered family.

Each family's decoder layer runs forward under PEFT LoRA (all default targets, dropout 0) over a frozen bf16 base on
the CPU, at the family's proportions and small widths; every tensor its autograd graph saves is counted once by
storage (parameters and buffers excluded). The estimate (:func:`~poros_lightning.memory.estimate.plan_memory`'s
``activation_layer_bytes``, the largest layer, with :data:`~poros_lightning.memory.estimate.LAYER_SAVES_FACTOR`)
must cover the largest layer's measurement and stay within 1.25 times it: a plan sized on a low estimate runs out
of memory (docs/benchmarks/families.jsonl), one sized on a high one wastes the budget.
"""

from __future__ import annotations

import pytest
import torch

from poros_lightning.arch import get_arch, transformers_knows
from poros_lightning.memory.estimate import plan_memory
from poros_lightning.quant.hf_config import build_from_config, hf_config

SEQ = 256
_DENSE = dict(hidden_size=448, intermediate_size=2368, num_hidden_layers=2, num_attention_heads=7, num_key_value_heads=1)
CONFIGS = {
    "qwen2": dict(model_type="qwen2", **_DENSE),
    "llama": dict(model_type="llama", **_DENSE),
    "mistral": dict(model_type="mistral", **_DENSE),
    "qwen3": dict(
        model_type="qwen3", hidden_size=640, intermediate_size=3200, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=1, head_dim=128,
    ),
    "qwen3_5_text": dict(  # Qwen3.5-27B's proportions: three Gated DeltaNet layers, then a full-attention one
        model_type="qwen3_5_text", hidden_size=640, intermediate_size=2176, num_hidden_layers=4,
        num_attention_heads=3, num_key_value_heads=1, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=6,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=672, intermediate_size=2688, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, sliding_window=128,
    ),
    "gemma4_text": dict(  # Gemma-4-31B's proportions: five sliding layers, then a global one (global_head_dim 512)
        model_type="gemma4_text", hidden_size=672, intermediate_size=2688, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=256, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, sliding_window=128,
    ),
}  # fmt: skip


def saved_bytes_per_layer(cfg: dict) -> list[int]:
    """Bytes each decoder layer's autograd graph saves (unique storages, parameters and buffers excluded)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = hf_config({**cfg, "vocab_size": 512})
    torch.manual_seed(0)
    model = build_from_config(AutoModelForCausalLM, config, dtype=torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    targets = list(get_arch(cfg["model_type"]).lora_targets)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets)).train()
    owned = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    layers = model.get_base_model().model.layers
    current: list[int | None] = [None]
    saved: list[dict[int, int]] = [{} for _ in layers]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if current[0] is not None and ptr not in owned:
            saved[current[0]][ptr] = t.untyped_storage().nbytes()
        return t

    def wrap(index: int, forward):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            current[0] = index
            try:
                return forward(*args, **kwargs)
            finally:
                current[0] = None

        return run

    for index, layer in enumerate(layers):
        layer.forward = wrap(index, layer.forward)
    ids = torch.randint(0, 512, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False)
    return [sum(s.values()) for s in saved]


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_estimate_covers_what_a_layer_saves(model_type: str) -> None:
    if transformers_knows(model_type) is False:
        pytest.skip(f"the installed transformers does not define {model_type}")
    cfg = CONFIGS[model_type]
    measured = max(saved_bytes_per_layer(cfg))
    estimate = plan_memory(hf_config({**cfg, "vocab_size": 512}).to_dict(), seq_len=SEQ).activation_layer_bytes
    assert measured <= estimate <= 1.25 * measured, (model_type, estimate / measured)
