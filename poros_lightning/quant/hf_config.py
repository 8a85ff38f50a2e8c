"""An HF config from a plain dict, its text config, and the model class its checkpoints use.

Invariant: every tool that builds a model from a config dict (``parity``, ``bench``, the random-weight loader)
reads the text decoder's facts through :func:`text_config`, so a multimodal config (``text_config`` nested) and a
config that leaves keys to the transformers defaults read the same as a flat, complete one; and builds the class
:func:`checkpoint_auto_class` names, so a multimodal family is gated as the class its published checkpoints load
as (``Qwen3_5ForConditionalGeneration``, not the text-only ``Qwen3_5ForCausalLM`` that ``AutoModelForCausalLM``
would build for ``qwen3_5``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from poros_lightning.errors import PorosConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["build_from_config", "checkpoint_auto_class", "hf_config", "text_config"]


def hf_config(config: dict[str, Any] | PretrainedConfig) -> PretrainedConfig:
    """The transformers config of ``config`` (a dict with ``model_type``); defaults fill the missing keys."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(config, dict):
        return config
    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if not isinstance(model_type, str):
        raise PorosConfigError(
            f"A model config needs a 'model_type' string, got {sorted(config)}.",
            "Add `model_type: qwen2` (or the family of the checkpoint) to the config.",
        )
    if model_type not in CONFIG_MAPPING:
        import transformers

        raise PorosConfigError(
            f"transformers {transformers.__version__} does not know model_type {model_type!r}.",
            "Check the spelling of model_type (docs/architecture-support.md lists the registered families), "
            "or upgrade transformers if the family is newer than it.",
        )
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except (ValueError, TypeError, KeyError, *_validation_errors()) as err:
        raise PorosConfigError(
            f"transformers cannot build a {model_type!r} config from the keys {sorted(cfg)}: {err}",
            "Use a model_type the installed transformers knows and keys of its config class "
            "(docs/architecture-support.md lists the registered families).",
        ) from err


def _validation_errors() -> tuple[type[Exception], ...]:
    """What transformers' config classes raise for a badly typed key (huggingface_hub's strict dataclasses)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: configs raise ValueError or TypeError
        return ()
    return (StrictDataclassError,)


def text_config(config: dict[str, Any] | PretrainedConfig) -> dict[str, Any]:
    """The text decoder's config as a dict, wherever it lives (``text_config`` nested or flat), defaults filled."""
    return hf_config(config).get_text_config().to_dict()


def checkpoint_auto_class(model_type: str) -> Any:
    """The transformers Auto class that builds what a ``model_type`` checkpoint holds.

    Multimodal families (``gemma3``, ``gemma4``, ``qwen3_5``) build their ``...ForConditionalGeneration``
    (vision towers included, as loaded from the checkpoint); text families build their ``...ForCausalLM``.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (
        AutoModelForImageTextToText
        if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        else AutoModelForCausalLM
    )


def build_from_config(auto_class: Any, config: PretrainedConfig, **kwargs: Any) -> Any:
    """``auto_class.from_config(config, **kwargs)``; a config transformers cannot build from is a clear error."""
    try:
        return auto_class.from_config(config, **kwargs)
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise PorosConfigError(
            f"transformers cannot build a {config.model_type!r} model from this config: {type(err).__name__}: {err}",
            "Fix or remove the config key the error names; keys left out take the transformers defaults.",
        ) from err
