"""What a decoder layer really saves for its backward, against the planner's kept-activation estimate.

Each family's decoder layers run forward under PEFT LoRA (all default targets, dropout 0) over a frozen bf16 base on
the CPU; every tensor their autograd graphs save is counted once by storage (parameters and buffers excluded). The
estimate is :func:`~poros_lightning.memory.estimate.plan_memory`'s ``activation_layer_bytes`` (the largest layer);
``formula`` is the same without :data:`~poros_lightning.memory.estimate.LAYER_SAVES_FACTOR`, the figure the factors
are measured against.

Regenerate ``docs/validation/activation_estimate.jsonl`` with
``python -m poros_lightning.tools.activation_probe --out docs/validation/activation_estimate.jsonl --full-width``
(small widths at each family's proportions, seq 256 and 512; ``--full-width`` adds a few layers of the real
Qwen3.5-27B, Gemma-4-31B, Gemma-3-27B and Qwen3-32B configs at seq 512, some minutes on a CPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["CONFIGS", "FULL_WIDTH", "measure", "saved_bytes_per_layer"]

_DENSE = dict(
    hidden_size=448, intermediate_size=2368, num_hidden_layers=2, num_attention_heads=7, num_key_value_heads=1
)
CONFIGS: dict[str, dict[str, Any]] = {
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
"""Small widths at each registered text family's proportions (the tests measure these)."""
FULL_WIDTH = {"Qwen/Qwen3.5-27B": 4, "google/gemma-4-31B": 6, "google/gemma-3-27b-it": 6, "Qwen/Qwen3-32B": 2}
"""Real configs, cut to this many layers (one of each layer kind), their text model at full width."""


def saved_bytes_per_layer(cfg: dict[str, Any], seq_len: int) -> list[int]:
    """Bytes each decoder layer's autograd graph saves (unique storages, parameters and buffers excluded)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from poros_lightning.arch import get_arch
    from poros_lightning.quant.hf_config import build_from_config, hf_config

    torch.manual_seed(0)
    model = build_from_config(AutoModelForCausalLM, hf_config(cfg), dtype=torch.bfloat16)
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

    def wrap(index: int, forward: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            current[0] = index
            try:
                return forward(*args, **kwargs)
            finally:
                current[0] = None

        return run

    for index, layer in enumerate(layers):
        layer.forward = wrap(index, layer.forward)
    vocab = int(model.get_base_model().config.vocab_size)
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False)
    return [sum(s.values()) for s in saved]


def measure(cfg: dict[str, Any], seq_len: int, label: str) -> dict[str, Any]:
    """One row: the measured bytes per layer, the estimate and the factor-free formula, and their ratios."""
    from poros_lightning.memory.estimate import LAYER_SAVES_FACTOR, plan_memory
    from poros_lightning.quant.hf_config import hf_config

    per_layer = saved_bytes_per_layer(cfg, seq_len)
    estimate = plan_memory(hf_config(cfg).to_dict(), seq_len=seq_len).activation_layer_bytes
    formula = estimate / LAYER_SAVES_FACTOR.get(cfg["model_type"], 1.0)
    measured = max(per_layer)
    return {
        "config": label,
        "model_type": cfg["model_type"],
        "seq_len": seq_len,
        "measured_per_layer": per_layer,
        "measured_max_bytes": measured,
        "estimate_bytes": estimate,
        "formula_bytes": round(formula),
        "measured_over_formula": round(measured / formula, 3),
        "estimate_over_measured": round(estimate / measured, 3),
    }


def _full_width(hub_id: str, layers: int) -> dict[str, Any]:
    from poros_lightning.tools.model_config import load_config

    config, _ = load_config(hub_id)
    text = dict(config.get("text_config") or config)
    text.setdefault("model_type", config["model_type"])
    text.pop("layer_types", None)
    return {**text, "num_hidden_layers": layers, "vocab_size": 1024}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m poros_lightning.tools.activation_probe", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", required=True, help="JSONL file to write (one row per config and sequence length)")
    p.add_argument("--full-width", action="store_true", help="also measure layers of the real configs at seq 512")
    args = p.parse_args(argv)
    jobs = [(dict(cfg, vocab_size=512), seq, f"small {name}") for name, cfg in CONFIGS.items() for seq in (256, 512)]
    if args.full_width:
        jobs += [(_full_width(hub_id, n), 512, hub_id) for hub_id, n in FULL_WIDTH.items()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for cfg, seq, label in jobs:
            row = measure(cfg, seq, label)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"{label} seq {seq}: measured/formula {row['measured_over_formula']}, "
                  f"estimate/measured {row['estimate_over_measured']}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
