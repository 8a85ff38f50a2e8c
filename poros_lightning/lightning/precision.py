"""PorosPrecision: Lightning's precision flag, plus the base's quantization mode. No streaming logic.

Invariant: ``convert_module`` never casts or moves a quantized tensor; the packed bytes a resident
bitsandbytes run would compute with are the bytes the streamed run computes with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from typing_extensions import override

from poros_lightning import quant
from poros_lightning.engine.optim_state import HostOptimizerState
from poros_lightning.errors import PorosConfigError

__all__ = ["PorosPrecision", "find_peft_models"]

_DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "bf16-mixed": torch.float32}


def find_peft_models(module: nn.Module) -> list[nn.Module]:
    """Every PEFT model held (at any depth) by ``module``, outermost first."""
    found: list[nn.Module] = []
    for sub in module.modules():
        if hasattr(sub, "peft_config") and callable(getattr(sub, "get_base_model", None)):
            if not any(sub in f.modules() for f in found):
                found.append(sub)
    return found


class PorosPrecision(Precision):
    """Precision plugin of :class:`~poros_lightning.PorosStrategy`.

    Args:
        precision: Lightning's precision flag, with its usual meaning: ``"32-true"`` (float32 adapters
            and activations outside the 4-bit matmuls), ``"bf16-true"`` (everything not quantized cast to
            bf16), ``"bf16-mixed"`` (autocast to bf16).
        quantization: base quantization when the module's base is not quantized yet: ``"nf4-dq"``,
            ``"nf4"``, ``"fp4"`` or ``"none"`` (stream the bf16 base). A base already quantized by
            bitsandbytes is streamed as it is.
        optimizer_on_host: keep the optimizer's per-parameter state in host memory between steps
            (:class:`~poros_lightning.engine.optim_state.HostOptimizerState`; exact, Note: [when the state moves]).
        optimizer_prefetch: with ``optimizer_on_host``, copy the state in during the backward's last quarter
            (hidden behind it); ``False``: copy it in after the backward. The strategy turns it off under
            block-major micro-batches, whose backward holds every micro-batch's gradients.
    """

    def __init__(
        self,
        precision: str = "32-true",
        quantization: str = "nf4-dq",
        optimizer_on_host: bool = False,
        optimizer_prefetch: bool = True,
    ) -> None:
        if precision not in _DTYPES:
            raise PorosConfigError(
                f"PorosStrategy does not support precision={precision!r}.",
                f"Use one of {', '.join(_DTYPES)} (fp16 with a 4-bit base is not supported).",
            )
        self.precision = precision  # type: ignore[assignment]
        self.quantization = quant.check_quantization(quantization)
        self.optimizer_on_host = optimizer_on_host
        self.optimizer_prefetch = optimizer_prefetch
        self._host_states: dict[int, HostOptimizerState] = {}

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the 4-bit matmuls when this plugin quantizes the base."""
        return torch.bfloat16

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        for peft_model in find_peft_models(module):
            if self.quantization != "none" and not quant.is_quantized(peft_model):
                quant.quantize_model(peft_model, self.quantization, self.compute_dtype)
            quant.disable_cpu_repacking(peft_model)
        if self.precision == "bf16-true":
            _cast_unquantized(module, torch.bfloat16)
        return module

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if not self.optimizer_on_host:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the torch one
        host = self._host_states.get(id(inner))
        if host is None or host.optimizer is not inner:
            prefetch_at = 0.25 if self.optimizer_prefetch else None  # Note: [when the state moves]
            host = self._host_states[id(inner)] = HostOptimizerState(inner, prefetch_at=prefetch_at)

        def closure_then_state() -> Any:
            host.arm()  # the backward's last quarter copies the state in (Note: [when the state moves])
            result = closure()
            host.to_device()
            return result

        result = super().optimizer_step(optimizer, model, closure_then_state, **kwargs)
        host.to_host()
        return result

    @override
    def teardown(self) -> None:
        for host in self._host_states.values():  # the host buffers hold the last update when fit returns
            host.synchronize()
        super().teardown()

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision == "bf16-mixed":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            with torch.autocast(device, dtype=torch.bfloat16, cache_enabled=False):  # as Lightning's MixedPrecision
                yield
        elif self.precision == "bf16-true":
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        else:
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.bfloat16) if torch.is_floating_point(t) else t

        return apply_to_collection(data, function=cast, dtype=torch.Tensor)


@torch.no_grad()
def _cast_unquantized(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters and buffers to ``dtype``, leaving 4-bit layers' packed weights alone."""
    for sub in module.modules():
        packed = getattr(sub, "weight", None) if quant.is_4bit_linear(sub) else None
        for param in sub._parameters.values():
            if param is not None and param is not packed and torch.is_floating_point(param):
                param.data = param.data.to(dtype)
        for name, buf in list(sub._buffers.items()):
            if buf is not None and torch.is_floating_point(buf) and "inv_freq" not in name:
                sub._buffers[name] = buf.to(dtype)
