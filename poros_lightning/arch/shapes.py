"""Parameter shapes of the registered families, computed from an HF config dict without torch.

Invariant: for every registered model type, the shapes listed here are the shapes the installed transformers
builds for ``AutoModelForCausalLM.from_config`` of the same config (tests compare parameter counts with a
meta-device model). Missing config keys take the defaults of the transformers configuration class.

The memory planner reads these shapes; the streaming engine never does (it walks the real modules).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LayerShape", "Linear", "ModelShapes", "model_shapes"]


@dataclass(frozen=True)
class Linear:
    """One ``nn.Linear``: ``name`` is its attribute name (the LoRA target name)."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False

    @property
    def weight_numel(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer: its linear layers and every other parameter (norms, biases, convolutions, gates)."""

    kind: str
    linears: tuple[Linear, ...]
    norm_params: int

    @property
    def linear_weight_params(self) -> int:
        return sum(lin.weight_numel for lin in self.linears)

    @property
    def small_params(self) -> int:
        """Parameters that are not linear weights: norms, biases, convolutions, gates."""
        return self.norm_params + sum(lin.out_features for lin in self.linears if lin.bias)

    @property
    def params(self) -> int:
        return self.linear_weight_params + self.small_params


@dataclass(frozen=True)
class ModelShapes:
    """The shapes of a whole causal LM as loaded by ``AutoModelForCausalLM``.

    Attributes:
        model_type: the config's ``model_type``.
        text: the effective text-decoder config (defaults filled in).
        layers: the decoder layers, in order (the streamed part).
        embed_params: token embeddings, plus per-layer-input embeddings where the family has them.
        head_params: the LM head weight; 0 when tied to the embeddings.
        norm_params: the final norm.
        outside_linears: ``nn.Linear`` modules outside the decoder layers other than the head (vision towers,
            projections); quantization replaces them too, and they stay resident.
        outside_small_params: every other parameter outside the decoder layers.
        notes: what the shapes leave out or assume.
    """

    model_type: str
    text: dict[str, Any]
    layers: tuple[LayerShape, ...]
    embed_params: int
    head_params: int
    norm_params: int
    outside_linears: tuple[Linear, ...] = ()
    outside_small_params: int = 0
    notes: tuple[str, ...] = ()

    @property
    def hidden_size(self) -> int:
        return int(self.text["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.text["vocab_size"])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def tied(self) -> bool:
        return self.head_params == 0

    @property
    def params_total(self) -> int:
        outside = sum(lin.weight_numel + (lin.out_features if lin.bias else 0) for lin in self.outside_linears)
        return (
            sum(layer.params for layer in self.layers)
            + self.embed_params
            + self.head_params
            + self.norm_params
            + outside
            + self.outside_small_params
        )


# Defaults of the transformers configuration classes for the keys read here.
_COMMON = {"attention_bias": False, "mlp_bias": False, "head_dim": None}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": False},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "tie_word_embeddings": False},
    "qwen3_5_text": {"vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                     "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                     "tie_word_embeddings": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                     "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                     "full_attention_interval": 4},
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "tie_word_embeddings": False},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True},
    "gemma4_text": {"vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True,
                    "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
                    "attention_k_eq_v": False, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
                    "global_head_dim": 512, "num_global_key_value_heads": None},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
                            "vision_use_head": True},
}  # fmt: skip

# Multimodal model types: (text model type, whether AutoModelForCausalLM loads the towers too).
_WRAPPERS: dict[str, tuple[str, bool]] = {
    "qwen3_5": ("qwen3_5_text", False),
    "gemma3": ("gemma3_text", True),
    "gemma4": ("gemma4_text", True),
}


def _filled(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    out = {**_COMMON, **_DEFAULTS.get(model_type, {})}
    out.update({k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "audio_config")})
    out["model_type"] = model_type
    if out.get("num_key_value_heads") is None:
        out["num_key_value_heads"] = out["num_attention_heads"]
    if not out.get("head_dim"):
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    return out


def _mlp(h: int, i: int, bias: bool = False) -> tuple[Linear, ...]:
    return (Linear("gate_proj", h, i, bias), Linear("up_proj", h, i, bias), Linear("down_proj", i, h, bias))


def _attention(h: int, nh: int, kv: int, hd: int, *, qkv_bias: bool, o_bias: bool, q_mult: int = 1):
    return (
        Linear("q_proj", h, nh * hd * q_mult, qkv_bias),
        Linear("k_proj", h, kv * hd, qkv_bias),
        Linear("v_proj", h, kv * hd, qkv_bias),
        Linear("o_proj", nh * hd, h, o_bias),
    )


def _dims(c: Mapping[str, Any]) -> tuple[int, int, int, int, int, int]:
    return (
        int(c["hidden_size"]),
        int(c["intermediate_size"]),
        int(c["num_attention_heads"]),
        int(c["num_key_value_heads"]),
        int(c["head_dim"]),
        int(c["num_hidden_layers"]),
    )


def _llama_like(c: Mapping[str, Any], *, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> list[LayerShape]:
    h, i, nh, kv, hd, n = _dims(c)
    linears = _attention(h, nh, kv, hd, qkv_bias=qkv_bias, o_bias=o_bias) + _mlp(h, i, bool(c.get("mlp_bias")))
    norms = 2 * h + (2 * hd if qk_norm else 0)
    return [LayerShape("attention", linears, norms) for _ in range(n)]


def _qwen3_5_layers(c: Mapping[str, Any]) -> list[LayerShape]:
    h, i, nh, kv, hd, n = _dims(c)
    types = c.get("layer_types") or [
        "linear_attention" if (j + 1) % int(c["full_attention_interval"]) else "full_attention" for j in range(n)
    ]
    nv, nk = int(c["linear_num_value_heads"]), int(c["linear_num_key_heads"])
    key_dim, value_dim = int(c["linear_key_head_dim"]) * nk, int(c["linear_value_head_dim"]) * nv
    conv_dim = 2 * key_dim + value_dim
    bias = bool(c.get("attention_bias"))
    layers = []
    for kind in types:
        if kind == "linear_attention":
            linears = (
                Linear("in_proj_qkv", h, conv_dim),
                Linear("in_proj_z", h, value_dim),
                Linear("in_proj_b", h, nv),
                Linear("in_proj_a", h, nv),
                Linear("out_proj", value_dim, h),
            )
            # depthwise conv1d, dt_bias, A_log, gated RMSNorm over the value head dim
            other = conv_dim * int(c["linear_conv_kernel_dim"]) + 2 * nv + int(c["linear_value_head_dim"])
        else:
            linears = _attention(h, nh, kv, hd, qkv_bias=bias, o_bias=bias, q_mult=2)  # q_proj carries the gate
            other = 2 * hd
        layers.append(LayerShape(kind, linears + _mlp(h, i), other + 2 * h))
    return layers


def _gemma4_layer_types(c: Mapping[str, Any], n: int) -> list[str]:
    types = list(c.get("layer_types") or ["sliding_attention" if (j + 1) % 6 else "full_attention" for j in range(n)])
    types[-1] = "full_attention"  # transformers forces the last layer to full attention
    return types


def _gemma4_layers(c: Mapping[str, Any]) -> tuple[list[LayerShape], int]:
    h, i, nh, kv, hd, n = _dims(c)
    types = _gemma4_layer_types(c, n)
    k_eq_v = bool(c.get("attention_k_eq_v"))
    overrides: dict[int, dict[str, Any]] = {}
    if c.get("per_layer_config") is not None:
        overrides = {int(k): dict(v) for k, v in c["per_layer_config"].items()}
    else:
        full = {"head_dim": int(c.get("global_head_dim") or 512)}
        if k_eq_v and c.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = int(c["num_global_key_value_heads"])
        overrides = {j: full for j, kind in enumerate(types) if kind == "full_attention"}
    shared = int(c.get("num_kv_shared_layers") or 0)
    first_shared = n - shared
    ple = int(c.get("hidden_size_per_layer_input") or 0)
    bias = bool(c.get("attention_bias"))
    layers = []
    for j, kind in enumerate(types):
        head_dim = int(overrides.get(j, {}).get("head_dim", hd))
        kv_heads = int(overrides.get(j, {}).get("num_key_value_heads", kv))
        is_shared = j >= first_shared
        linears = [Linear("q_proj", h, nh * head_dim, bias)]
        other = head_dim  # q_norm
        if not is_shared:
            linears.append(Linear("k_proj", h, kv_heads * head_dim, bias))
            if not (k_eq_v and kind != "sliding_attention"):
                linears.append(Linear("v_proj", h, kv_heads * head_dim, bias))
            other += head_dim  # k_norm (v_norm has no scale)
        linears.append(Linear("o_proj", nh * head_dim, h, bias))
        width = i * (2 if c.get("use_double_wide_mlp") and is_shared else 1)
        linears.extend(_mlp(h, width))
        other += 4 * h
        if ple:
            linears += [Linear("per_layer_input_gate", h, ple), Linear("per_layer_projection", ple, h)]
            other += h
        layers.append(LayerShape(kind, tuple(linears), other))
    return layers, ple


def _siglip(v: Mapping[str, Any]) -> tuple[tuple[Linear, ...], int]:
    h, i, n = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_hidden_layers"])
    block = (
        Linear("q_proj", h, h, True),
        Linear("k_proj", h, h, True),
        Linear("v_proj", h, h, True),
        Linear("out_proj", h, h, True),
        Linear("fc1", h, i, True),
        Linear("fc2", i, h, True),
    )
    linears = block * n
    patch = int(v["patch_size"])
    other = int(v["num_channels"]) * patch * patch * h + h  # patch conv
    other += (int(v["image_size"]) // patch) ** 2 * h  # position embedding
    other += n * 4 * h + 2 * h  # two LayerNorms per layer, post LayerNorm
    if v.get("vision_use_head"):
        linears += (Linear("out_proj", h, h, True), Linear("fc1", h, i, True), Linear("fc2", i, h, True))
        other += h + 3 * h * h + 3 * h + 2 * h  # probe, packed in-projection, LayerNorm
    return linears, other


def model_shapes(cfg: Mapping[str, Any]) -> ModelShapes:
    """The shapes of the model ``AutoModelForCausalLM.from_config(cfg)`` builds.

    Registered families are exact. Any other model type is read as a Llama-style decoder (``attention_bias``
    / ``mlp_bias`` honoured) and the result says so in ``notes``.
    """
    model_type = str(cfg.get("model_type", ""))
    notes: list[str] = []
    text_type, loads_towers = _WRAPPERS.get(model_type, (model_type, False))
    raw_text = cfg.get("text_config") if model_type in _WRAPPERS else None
    c = _filled(raw_text or {}, text_type) if model_type in _WRAPPERS else _filled(cfg, model_type)
    if model_type in _WRAPPERS:
        # Composite configs keep tie_word_embeddings at the top level; a text-only load reads the text config.
        top_tie = cfg.get("tie_word_embeddings")
        if loads_towers and top_tie is not None:
            c["tie_word_embeddings"] = top_tie
    h, vocab, n = int(c["hidden_size"]), int(c["vocab_size"]), int(c["num_hidden_layers"])
    embed = vocab * h
    outside: tuple[Linear, ...] = ()
    outside_small = 0
    if text_type == "qwen2":
        layers = _llama_like(c, qkv_bias=True, o_bias=False, qk_norm=False)
    elif text_type in ("llama", "mistral"):
        layers = _llama_like(c, qkv_bias=bool(c["attention_bias"]), o_bias=bool(c["attention_bias"]), qk_norm=False)
    elif text_type in ("qwen3", "gemma3_text"):
        bias = bool(c["attention_bias"])
        layers = _llama_like(c, qkv_bias=bias, o_bias=bias, qk_norm=True)
        if text_type == "gemma3_text":  # pre/post feed-forward norms
            layers = [LayerShape(x.kind, x.linears, x.norm_params + 2 * h) for x in layers]
    elif text_type == "qwen3_5_text":
        layers = _qwen3_5_layers(c)
    elif text_type == "gemma4_text":
        layers, ple = _gemma4_layers(c)
        if ple:
            embed += int(c["vocab_size_per_layer_input"]) * n * ple
            outside += (Linear("per_layer_model_projection", h, n * ple),)
            outside_small += ple
    else:
        bias = bool(c["attention_bias"])
        layers = _llama_like(c, qkv_bias=bias, o_bias=bias, qk_norm=False)
        notes.append(f"model_type '{model_type}' is not registered: shapes assume a Llama-style decoder layer.")
    if model_type == "qwen3_5":
        notes.append("AutoModelForCausalLM loads the text model only; the vision tower is not loaded or counted.")
    elif model_type == "gemma3":
        vision = {**_DEFAULTS["siglip_vision_model"], **(cfg.get("vision_config") or {})}
        tower, tower_other = _siglip(vision)
        outside += tower
        vh = int(vision["hidden_size"])
        outside_small += tower_other + vh * h + vh  # projector weight and its RMSNorm
    elif model_type == "gemma4":
        notes.append("the vision/audio towers of this multimodal checkpoint are not included in the estimate.")
    tied = bool(c.get("tie_word_embeddings"))
    return ModelShapes(
        model_type=model_type,
        text=c,
        layers=tuple(layers),
        embed_params=embed,
        head_params=0 if tied else vocab * h,
        norm_params=h,
        outside_linears=outside,
        outside_small_params=outside_small,
        notes=tuple(notes),
    )
