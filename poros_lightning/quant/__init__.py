"""bitsandbytes lives here and only here.

Quantizes a model's linear layers to 4 bit the way ``transformers``' ``BitsAndBytesConfig`` load does
(same ``Linear4bit`` modules, same ``quantize_4bit`` call on the same bf16 bytes, on the device the
weight is on), and tells the engine which tensors of a quantized layer are the frozen bytes to stream.
``bitsandbytes`` is imported lazily, on first use.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from types import ModuleType

import torch
from torch import nn

from poros_lightning._logging import log_count
from poros_lightning.errors import PorosConfigError, PorosError

log = logging.getLogger(__name__)

__all__ = [
    "QUANTIZATIONS",
    "bnb",
    "is_4bit_linear",
    "is_quantized",
    "move_quant_states",
    "check_quantization",
    "quantize_model",
    "disable_cpu_repacking",
    "streamable_tensors",
]

QUANTIZATIONS: tuple[str, ...] = ("nf4-dq", "nf4", "fp4", "none")
"""Base quantization modes: NF4 with double quantization (default), NF4, FP4, or no quantization."""

_MODES = {"nf4-dq": ("nf4", True), "nf4": ("nf4", False), "fp4": ("fp4", False)}


@functools.cache
def bnb() -> ModuleType:
    """Import bitsandbytes once, with an error that names the fix when it is missing."""
    try:
        import bitsandbytes
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise PorosError(
            f"bitsandbytes is needed for a quantized base but cannot be imported ({err}).",
            "pip install bitsandbytes, or use quantization='none' to stream a bf16 base.",
        ) from err
    return bitsandbytes


def check_quantization(quantization: str) -> str:
    """Validate a quantization mode name and return it."""
    if quantization not in QUANTIZATIONS:
        raise PorosConfigError(
            f"Unknown quantization {quantization!r}.",
            f"Use one of {', '.join(QUANTIZATIONS)}.",
        )
    return quantization


def is_4bit_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes 4-bit linear layer (checked without importing bitsandbytes)."""
    return hasattr(getattr(module, "weight", None), "quant_state") and type(module).__name__.endswith("Linear4bit")


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is a bitsandbytes 4-bit linear layer."""
    return any(is_4bit_linear(m) for m in model.modules())


def disable_cpu_repacking(model: nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit weights in place on CPUs with avx512_bf16.

    bitsandbytes converts a ``Linear4bit`` weight to a CPU-only packed layout after an eval-mode
    forward whose input needs no grad (a validation pass, Lightning's sanity check); training after
    that fails or silently returns no input gradient. Training must see the same bytes as the forward.
    """
    for module in model.modules():
        if is_4bit_linear(module):
            module.support_avx512bf16_for_cpu = False


def _linear_names(model: nn.Module, skip: tuple[str, ...]) -> list[str]:
    names = []
    for name, module in model.named_modules():
        adapter = any(part.startswith("lora_") for part in name.split("."))  # PEFT's own layers stay trainable
        if type(module) is nn.Linear and not adapter and not any(name == s or name.endswith("." + s) for s in skip):
            names.append(name)
    return names


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    quantization: str = "nf4-dq",
    compute_dtype: torch.dtype = torch.bfloat16,
    skip: tuple[str, ...] = ("lm_head",),
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (except names in ``skip``) by a quantized ``Linear4bit``.

    Quantization runs on the device each weight is on (CPU in CI, the GPU on a GPU), one layer at a
    time, so a resident bitsandbytes load and this produce identical bytes.

    Args:
        model: the model to convert in place.
        quantization: one of :data:`QUANTIZATIONS`; ``"none"`` leaves the model as it is.
        compute_dtype: dtype the 4-bit matmuls compute in.
        skip: module names (or name suffixes) to leave unquantized; the LM head by default.

    Returns:
        The same ``model``.
    """
    check_quantization(quantization)
    if quantization == "none":
        return model
    quant_type, double_quant = _MODES[quantization]
    lib = bnb()
    names, start = list(_linear_names(model, skip)), time.perf_counter()
    for done, name in enumerate(names, start=1):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old: nn.Linear = getattr(parent, child)
        new = lib.nn.Linear4bit(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=double_quant,
            quant_type=quant_type,
            device="meta",
        )
        device = old.weight.device
        new.weight = lib.nn.Params4bit(
            old.weight.data.contiguous(),
            requires_grad=False,
            compress_statistics=double_quant,
            quant_type=quant_type,
            module=new,
        ).to(device)
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.data, requires_grad=False)
        new.support_avx512bf16_for_cpu = False
        new.train(old.training)
        setattr(parent, child, new)
        log_count(log, f"poros: quantizing linear layers to {quantization}", done, len(names), start, min_total=64)
    return model


def streamable_tensors(module: nn.Module) -> Iterator[tuple[object, str]]:
    """Yield ``(owner, attribute)`` for every frozen tensor of ``module`` worth streaming.

    For a 4-bit layer: the packed weight, its absmax and, with double quantization, the nested
    absmax. For a frozen ``nn.Linear`` (unquantized base): its weight. Small tensors (biases, the
    quantization code tables, offsets) stay resident: they are cheap and some are shared.
    """
    for sub in module.modules():
        if is_4bit_linear(sub):
            state = sub.weight.quant_state
            yield sub, "weight"
            yield state, "absmax"
            if getattr(state, "nested", False):
                yield state.state2, "absmax"
        elif isinstance(sub, nn.Linear) and not sub.weight.requires_grad:
            yield sub, "weight"


def move_quant_states(model: nn.Module, device: torch.device) -> None:
    """Move the quantization state tensors of every 4-bit layer of ``model`` to ``device``, in place.

    Only tensors not already on ``device`` move (streamed absmax tensors are slot views there). The
    ``QuantState`` objects stay the same objects: never call ``Params4bit.to`` on a streamed layer,
    it rebuilds the parameter and moves the shared state behind the engine's back.
    """
    for module in model.modules():
        if not is_4bit_linear(module):
            continue
        states = [module.weight.quant_state]
        if getattr(states[0], "nested", False):
            states.append(states[0].state2)
        for state in states:
            for name in ("absmax", "code", "offset"):
                value = getattr(state, name, None)
                if isinstance(value, torch.Tensor) and value.device != device:
                    setattr(state, name, value.to(device))
