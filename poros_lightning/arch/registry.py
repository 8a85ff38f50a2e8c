"""The architecture registry: where each supported family keeps its blocks, embeddings, norm and head.

Invariant: a model is streamed only when its ``model_type`` is registered here (or the caller opted in with
``allow_unlisted=True``), and fused-expert MoE models are never streamed. Every path is a dotted attribute path
from the object whose ``config.model_type`` is the key, i.e. the ``*ForCausalLM`` or
``*ForConditionalGeneration`` module (the base model of a ``PeftModel``).

This module imports neither torch nor transformers: ``poros-lightning check`` uses it on machines that only
want a memory plan.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

from poros_lightning.arch.status import Gate, guarantee, largest_gate, statuses
from poros_lightning.errors import UnsupportedArchitectureError

__all__ = [
    "DOC_LINK",
    "MOE_MODEL_TYPES",
    "STANDARD_TARGETS",
    "ArchSpec",
    "Status",
    "UnlistedArchitectureWarning",
    "arch_for_config",
    "arch_for_model",
    "get_arch",
    "guarantee",
    "registered",
    "resolve",
    "transformers_knows",
]

Status = Literal["certified", "experimental", "target"]

DOC_LINK = "docs/architecture-support.md"

#: LoRA targets of a Llama-style decoder layer: attention and gated MLP projections.
STANDARD_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: Fused-expert mixture-of-experts model types. Their experts are packed 3-D parameters, not ``nn.Linear``
#: modules, so neither NF4 quantization per linear layer nor per-block streaming applies to them.
MOE_MODEL_TYPES: frozenset[str] = frozenset({
    "dbrx", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "flex_olmo", "gpt_oss", "granitemoe",
    "granitemoehybrid", "granitemoeshared", "jamba", "llama4", "llama4_text", "mixtral", "olmoe", "phimoe",
    "qwen2_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "qwen3_vl_moe",
    "qwen3_vl_moe_text",
})  # fmt: skip

# Config keys whose positive value marks a mixture-of-experts checkpoint even under a dense model_type.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class UnlistedArchitectureWarning(UserWarning):
    """An unregistered ``model_type`` is used through ``allow_unlisted=True`` with a guessed layout."""


@dataclass(frozen=True)
class ArchSpec:
    """Where one architecture keeps the parts the streaming engine touches.

    Attributes:
        model_type: the HF ``config.model_type`` this entry is keyed by.
        family: the family name shown to users (several model types can share one).
        layers: dotted path of the decoder ``nn.ModuleList`` (the streamed blocks).
        embed: dotted path of the input token embedding (kept resident).
        norm: dotted path of the final norm (kept resident).
        head: dotted path of the LM head (kept resident, never quantized).
        lora_targets: names of the linear layers inside a decoder layer that LoRA adapts by default.
        status: ``"certified"``, ``"experimental"`` or ``"target"``.
        notes: what is and is not supported for this model type.
        gate: the committed GPU parity gate at the largest scale, for certified entries (all: ``status.gates``).
        guessed: True when the layout was guessed for an unlisted model type.
        body: dotted path of the module the HF forward calls for the final hidden states (its first output),
            to which it then applies the head.
        logit_softcap: whether the HF forward soft-caps the head's output,
            ``cap * tanh(logits / cap)`` with ``cap`` = the text config's ``final_logit_softcapping`` (when set).
            A loss that applies the head itself (``LoRALightningModule(loss_chunk_tokens=...)``) does the same.
    """

    model_type: str
    family: str
    layers: str
    embed: str
    norm: str
    head: str
    lora_targets: tuple[str, ...]
    status: Status
    notes: str = ""
    gate: Gate | None = None
    guessed: bool = False
    body: str = "model"
    logit_softcap: bool = False

    @property
    def guarantee(self) -> str:
        """The parity guarantee this status carries, in one line."""
        return guarantee(self.status, self.gate)

    def peft_target_modules(self) -> str:
        """A PEFT ``target_modules`` regex that adapts ``lora_targets`` inside the decoder layers only.

        Multimodal checkpoints reuse names such as ``q_proj`` in their vision towers; a plain list of names
        would adapt those too. PEFT matches a string ``target_modules`` with ``re.fullmatch`` against module
        names relative to the model passed to ``get_peft_model``.
        """
        layers = self.layers.replace(".", r"\.")
        names = "|".join(self.lora_targets)
        return rf"{layers}\.\d+\.(?:.+\.)?(?:{names})"


@dataclass(frozen=True)
class _Entry:
    family: str
    layers: str
    embed: str
    norm: str
    head: str
    lora_targets: tuple[str, ...]
    notes: str
    hf_module: str  # directory under transformers/models that defines this model type
    logit_softcap: bool = False  # the HF forward applies final_logit_softcapping after the head


_TEXT = ("model.layers", "model.embed_tokens", "model.norm", "lm_head")
_MULTIMODAL = (
    "model.language_model.layers",
    "model.language_model.embed_tokens",
    "model.language_model.norm",
    "lm_head",
)

# Qwen3.5 dense mixes full-attention layers (q/k/v/o) with Gated DeltaNet linear-attention layers
# (in_proj_qkv/in_proj_z/in_proj_b/in_proj_a/out_proj); every layer has the gated MLP.
_QWEN3_5_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

_ENTRIES: dict[str, _Entry] = {
    "qwen2": _Entry(
        "qwen2", *_TEXT, STANDARD_TARGETS, "Qwen2, Qwen2.5 and DeepSeek-R1-Distill-Qwen checkpoints.", "qwen2"
    ),
    "qwen3": _Entry("qwen3", *_TEXT, STANDARD_TARGETS, "Dense Qwen3 checkpoints (MoE Qwen3 is qwen3_moe).", "qwen3"),
    "qwen3_5_text": _Entry(
        "qwen3_5",
        *_TEXT,
        _QWEN3_5_TARGETS,
        "Dense Qwen3.5 text model (Qwen3_5ForCausalLM): hybrid Gated DeltaNet linear-attention and full-attention "
        "layers; LoRA adapts the projections of both layer kinds.",
        "qwen3_5",
    ),
    "qwen3_5": _Entry(
        "qwen3_5",
        *_MULTIMODAL,
        _QWEN3_5_TARGETS,
        "Multimodal Qwen3.5 checkpoint. AutoModelForCausalLM loads its text model only (Qwen3_5ForCausalLM, "
        "model_type qwen3_5_text); as Qwen3_5ForConditionalGeneration the decoder under model.language_model "
        "streams, the vision tower stays resident and unadapted, and image inputs are not parity-tested.",
        "qwen3_5",
    ),
    "llama": _Entry(
        "llama", *_TEXT, STANDARD_TARGETS, "Llama 2/3.x and Llama-architecture models such as SmolLM2.", "llama"
    ),
    "mistral": _Entry(
        "mistral", *_TEXT, STANDARD_TARGETS, "Mistral 7B-style dense models (Mixtral is MoE).", "mistral"
    ),
    "gemma3_text": _Entry(
        "gemma3",
        *_TEXT,
        STANDARD_TARGETS,
        "Text-only Gemma 3 (Gemma3ForCausalLM, e.g. gemma-3-1b).",
        "gemma3",
        logit_softcap=True,
    ),
    "gemma3": _Entry(
        "gemma3",
        *_MULTIMODAL,
        STANDARD_TARGETS,
        "Multimodal Gemma 3 (Gemma3ForConditionalGeneration, e.g. gemma-3-4b/12b/27b): text fine-tuning only. The "
        "decoder under model.language_model streams; the SigLIP vision tower and projector stay resident and "
        "unadapted; image inputs are not parity-tested. Use peft_target_modules() so LoRA skips the vision tower.",
        "gemma3",
        logit_softcap=False,  # transformers' Gemma3ForConditionalGeneration applies no final soft cap
    ),
    "gemma4_text": _Entry(
        "gemma4",
        *_TEXT,
        STANDARD_TARGETS,
        "Text-only dense Gemma 4 (Gemma4ForCausalLM). Per-layer-input projections, when present, are not adapted "
        "by default; the MoE variant (enable_moe_block) is out of scope.",
        "gemma4",
        logit_softcap=True,
    ),
    "gemma4": _Entry(
        "gemma4",
        *_MULTIMODAL,
        STANDARD_TARGETS,
        "Multimodal dense Gemma 4 (Gemma4ForConditionalGeneration): text fine-tuning only. The decoder under "
        "model.language_model streams; vision and audio towers stay resident and unadapted; image/audio inputs are "
        "not parity-tested. Use peft_target_modules() so LoRA skips the towers.",
        "gemma4",
        logit_softcap=True,
    ),
}


@cache
def _transformers_models_dir() -> Path | None:
    # find_spec on a top-level name does not import the package (transformers would import torch).
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def transformers_knows(model_type: str) -> bool | None:
    """Whether the installed transformers defines a registered ``model_type`` (None: transformers not installed)."""
    models = _transformers_models_dir()
    if models is None:
        return None
    entry = _ENTRIES.get(model_type)
    module = entry.hf_module if entry else model_type
    return (models / module).is_dir()


def _spec(model_type: str, entry: _Entry) -> ArchSpec:
    state = statuses().get(model_type, {"status": "target", "gates": []})
    return ArchSpec(
        model_type=model_type,
        family=entry.family,
        layers=entry.layers,
        embed=entry.embed,
        norm=entry.norm,
        head=entry.head,
        lora_targets=entry.lora_targets,
        status=state["status"],
        notes=entry.notes,
        gate=largest_gate(model_type, {model_type: state}),
        logit_softcap=entry.logit_softcap,
    )


def registered(*, include_unavailable: bool = False) -> dict[str, ArchSpec]:
    """Every registered model type and its spec, sorted by model type.

    Args:
        include_unavailable: also list model types the installed transformers does not define.
    """
    return {
        model_type: _spec(model_type, entry)
        for model_type, entry in sorted(_ENTRIES.items())
        if include_unavailable or transformers_knows(model_type) is not False
    }


def _supported_summary() -> str:
    """``family (model_type: status, ...)`` for every family, e.g. ``qwen2 (qwen2: experimental)``."""
    by_family: dict[str, list[str]] = {}
    for model_type, spec in registered().items():
        by_family.setdefault(spec.family, []).append(f"{model_type}: {spec.status}")
    return ", ".join(f"{family} ({'; '.join(types)})" for family, types in sorted(by_family.items()))


def _is_moe(model_type: str) -> bool:
    return model_type in MOE_MODEL_TYPES or "moe" in model_type.split("_")


def _moe_error(model_type: str, why: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"model_type '{model_type}' is a fused-expert mixture-of-experts model ({why}); fused-expert MoE is out of "
        "scope for poros-lightning: its experts are packed 3-D parameters, not linear layers that can be quantized "
        "and streamed block by block.",
        hint=f"use a dense checkpoint of a supported family ({_supported_summary()}); see {DOC_LINK}. "
        "allow_unlisted=True does not apply to MoE models.",
    )


def get_arch(model_type: str, *, allow_unlisted: bool = False) -> ArchSpec:
    """Look up the architecture spec of an HF ``model_type``.

    Args:
        model_type: ``config.model_type`` of the model (e.g. ``"qwen2"``).
        allow_unlisted: opt in, at your own risk, to an unregistered (or only planned) model type. The spec
            is then ``experimental``; for an unregistered type the layout is *guessed* as ``model.layers`` /
            ``model.embed_tokens`` / ``model.norm`` / ``lm_head`` with the standard LoRA targets, and an
            ``UnlistedArchitectureWarning`` says so.

    Raises:
        UnsupportedArchitectureError: the model type is a fused-expert MoE (always), is unregistered, is only
            planned (``target``), or is not defined by the installed transformers.
    """
    if _is_moe(model_type):
        raise _moe_error(model_type, "known MoE model_type")
    entry = _ENTRIES.get(model_type)
    if entry is not None:
        if transformers_knows(model_type) is False:
            from importlib.metadata import version

            raise UnsupportedArchitectureError(
                f"model_type '{model_type}' is registered, but the installed transformers "
                f"{version('transformers')} does not define it.",
                hint=f"upgrade transformers (pip install -U transformers); see {DOC_LINK}.",
            )
        spec = _spec(model_type, entry)
        if spec.status != "target":
            return spec
        if not allow_unlisted:
            raise UnsupportedArchitectureError(
                f"model_type '{model_type}' is planned but not supported yet (status 'target').",
                hint=f"pass allow_unlisted=True (--allow-unlisted) to try it at your own risk; see {DOC_LINK}.",
            )
        warnings.warn(
            f"model_type '{model_type}' is only planned (status 'target'); using it as experimental at your own "
            "risk: streamed training is not parity-tested for it.",
            UnlistedArchitectureWarning,
            stacklevel=2,
        )
        return replace(spec, status="experimental", notes=f"{spec.notes} Opted in with allow_unlisted.".strip())
    if not allow_unlisted:
        raise UnsupportedArchitectureError(
            f"model_type '{model_type}' is not in the poros-lightning architecture registry. "
            f"Supported: {_supported_summary()}.",
            hint=f"to add a family, register it with a CPU parity test ({DOC_LINK}, 'Adding a family'); to try "
            "it anyway at your own risk, pass allow_unlisted=True (CLI: --allow-unlisted).",
        )
    warnings.warn(
        f"model_type '{model_type}' is not registered; guessing the standard layout (model.layers, "
        "model.embed_tokens, model.norm, lm_head) and using it as experimental at your own risk: streamed "
        f"training is not parity-tested for it ({DOC_LINK}).",
        UnlistedArchitectureWarning,
        stacklevel=2,
    )
    return ArchSpec(
        model_type=model_type,
        family=model_type,
        layers=_TEXT[0],
        embed=_TEXT[1],
        norm=_TEXT[2],
        head=_TEXT[3],
        lora_targets=STANDARD_TARGETS,
        status="experimental",
        notes="Unlisted model type: layout guessed as model.layers / model.embed_tokens / model.norm / lm_head; "
        "not parity-tested (opted in with allow_unlisted).",
        guessed=True,
    )


def _moe_marker(cfg: Mapping[str, Any]) -> str | None:
    for key in _MOE_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return f"{key}={value}"
    if cfg.get("enable_moe_block"):
        return "enable_moe_block=true"
    return None


def arch_for_config(cfg: Mapping[str, Any], *, allow_unlisted: bool = False) -> ArchSpec:
    """Look up the spec of an HF config dict (``config.json`` contents), refusing MoE variants of dense types.

    Some model types cover both dense and MoE checkpoints (Gemma 4's ``enable_moe_block``); the config, not
    the model type alone, tells them apart.

    Raises:
        UnsupportedArchitectureError: see :func:`get_arch`; also when the config has no ``model_type``.
    """
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UnsupportedArchitectureError(
            "the config has no 'model_type'.",
            hint="pass a Hugging Face config.json (or its directory) that names its model_type.",
        )
    for sub in (cfg, cfg.get("text_config") or {}):
        marker = _moe_marker(sub)
        if marker:
            raise _moe_error(model_type, f"config has {marker}")
    return get_arch(model_type, allow_unlisted=allow_unlisted)


def resolve(model: Any, path: str) -> Any:
    """Walk a dotted attribute path (``"model.layers"``) from ``model``.

    Raises:
        UnsupportedArchitectureError: a part of the path is missing; the message names the part and the
            object that lacks it.
    """
    obj = model
    walked: list[str] = []
    for part in path.split("."):
        if not hasattr(obj, part):
            where = ".".join(walked) or "<root>"
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} has no '{path}': '{where}' ({type(obj).__name__}) has no attribute '{part}'.",
                hint=f"the model's layout differs from its registry entry; check the model class and {DOC_LINK}.",
            )
        obj = getattr(obj, part)
        walked.append(part)
    return obj


def _model_config_dict(config: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model_type": getattr(config, "model_type", None)}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in (*_MOE_KEYS, "enable_moe_block"):
        value = getattr(text, key, None)
        if value is not None:
            out[key] = value
    return out


def arch_for_model(model: Any, *, allow_unlisted: bool = False) -> ArchSpec:
    """The spec of a PEFT ``PeftModel`` or HF ``PreTrainedModel``, checked against the model's real layout.

    Paths in the spec are relative to the HF model (``model.get_base_model()`` for a ``PeftModel``).

    Raises:
        UnsupportedArchitectureError: unsupported model type (see :func:`get_arch`), or a path of the spec is
            missing on this model.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} has no .config; expected a Hugging Face PreTrainedModel or a PeftModel.",
            hint="load the model with transformers (AutoModelForCausalLM) or poros_lightning.training.models.",
        )
    spec = arch_for_config(_model_config_dict(config), allow_unlisted=allow_unlisted)
    for path in (spec.layers, spec.embed, spec.norm, spec.head):
        resolve(base, path)
    return spec
