"""Block-major micro-batches: every micro-batch passes through a block before the next block is loaded.

With ``k`` micro-batches per optimizer step, layer-major accumulation (Lightning's
``accumulate_grad_batches=k``) streams the whole base ``k`` times per step. Block-major runs one batch
of ``k * b`` rows whose decoder layers, final norm and LM head each compute their ``k`` row chunks one
after the other, so each block is copied once per forward and once per backward for all ``k``.

Invariant: every kernel sees exactly the shapes and bytes of one micro-batch of ``b`` rows, and every
trainable parameter's gradient is summed over micro-batches in micro-batch order, as
``accumulate_grad_batches=k`` sums it.

Note: [ordered gradient sum]
    Within one backward, autograd adds the gradient contributions a parameter receives from the ``k``
    chunks in the order its scheduler happens to run them; float addition is not associative, so for
    ``k >= 3`` the bytes would depend on that schedule. Instead each chunk reads each trainable
    parameter through :class:`_Capture`, an identity whose backward stores that chunk's gradient and
    passes nothing on; :meth:`MicroBatches.accumulate` then adds the stored gradients into ``.grad`` in
    micro-batch order, ``grad = g_1``, ``grad += g_2``, ..., exactly the additions layer-major
    accumulation performs.

Note: [what block-major cannot reproduce]
    RNG draws happen in another order (micro-batch 2 of layer 1 draws before micro-batch 1 of layer 2),
    so any dropout makes it differ from layer-major accumulation: :func:`check_block_major` refuses it.
    The per-micro-batch loss must be computed by the module (:func:`micro_batches_of` tells it ``k``);
    a loss over the whole ``k * b`` batch has another normalization.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from poros_lightning.errors import PorosConfigError

__all__ = ["MicroBatches", "micro_batch_mean", "micro_batches_of"]

_ATTR = "_poros_micro_batches"


def micro_batches_of(model: nn.Module) -> int:
    """``k`` when block-major micro-batches are installed on ``model`` (PEFT wrapper or base), else 1."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    found = getattr(base, _ATTR, None)
    return found.k if found is not None else 1


def micro_batch_mean(
    loss_fn: Callable[..., torch.Tensor], k: int, *tensors: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``sum_i loss_fn(chunk_i) / k`` over the ``k`` row chunks of ``tensors``, and the ``k`` terms.

    Each term is computed as Lightning's gradient accumulation computes it (``loss / k``), so the
    gradients equal those of ``accumulate_grad_batches=k`` over the same micro-batches.
    """
    terms = [loss_fn(*(t.chunk(k, 0)[i] for t in tensors)) / k for i in range(k)]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total, terms


class _Capture(torch.autograd.Function):
    """Identity on a parameter; the backward stores the incoming gradient instead of passing it on."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, store: dict[tuple[int, int], torch.Tensor], key: tuple[int, int]):
        ctx.store, ctx.key = store, key
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        if ctx.key in ctx.store:  # the same chunk read the parameter twice: autograd order, as resident
            ctx.store[ctx.key] = ctx.store[ctx.key] + grad
        else:
            ctx.store[ctx.key] = grad
        return None, None, None


class MicroBatches:
    """Runs the decoder layers, the final norm and the head of ``base`` micro-batch by micro-batch.

    Args:
        base: the Hugging Face causal LM (not the PEFT wrapper).
        modules: the modules to split, in execution order (decoder layers, final norm, LM head).
        k: micro-batches per batch; the batch's first dimension must be a multiple of ``k``.
    """

    def __init__(self, base: nn.Module, modules: list[nn.Module], k: int) -> None:
        if k < 2:
            raise PorosConfigError(
                f"micro_batches must be >= 2 to split, got {k}.", "Use micro_batches=1 to turn it off."
            )
        self.base, self.modules, self.k = base, modules, k
        self.params: list[nn.Parameter] = []
        self.store: dict[tuple[int, int], torch.Tensor] = {}
        self.fault: str | None = None  # "reversed_sum": negative control for the tests only
        self._saved: list[tuple[nn.Module, Any]] = []
        owned: set[int] = set()
        for module in modules:
            for p in module.parameters():
                if p.requires_grad and id(p) not in owned:
                    owned.add(id(p))
                    self.params.append(p)
        stray = [n for n, p in base.named_parameters() if p.requires_grad and id(p) not in owned]
        if stray:
            raise PorosConfigError(
                f"Block-major micro-batches split the decoder layers, the final norm and the head only; these "
                f"trainable tensors live elsewhere: {stray[:3]}.",
                "Keep LoRA on the decoder's linear layers (the default targets), or use micro_batches=1.",
            )

    def install(self) -> None:
        if getattr(self.base, _ATTR, None) is not None:
            raise PorosConfigError("Block-major micro-batches are already installed.", "Install them once.")
        for module in self.modules:
            self._saved.append((module, module.__dict__.get("forward")))
            module.forward = functools.partial(self._forward, module, module.forward)
        setattr(self.base, _ATTR, self)

    def uninstall(self) -> None:
        for module, previous in self._saved:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._saved = []
        self.store.clear()
        self.base.__dict__.pop(_ATTR, None)

    @contextlib.contextmanager
    def _captured(self, module: nn.Module, chunk: int) -> Iterator[None]:
        """Inside ``module``, every trainable parameter is read through a :class:`_Capture` of ``chunk``."""
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        try:
            for owner in module.modules():
                for name, p in list(owner._parameters.items()):
                    if p is not None and p.requires_grad:
                        del owner._parameters[name]
                        setattr(owner, name, _Capture.apply(p, self.store, (id(p), chunk)))
                        swapped.append((owner, name, p))
            yield
        finally:
            for owner, name, p in swapped:
                delattr(owner, name)
                owner._parameters[name] = p

    def _forward(self, module: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing accumulates, any batch size goes
            return original(*args, **kwargs)
        lead = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        rows = lead.shape[0]
        if rows % self.k:
            raise PorosConfigError(
                f"A batch of {rows} rows cannot be split into {self.k} equal micro-batches.",
                f"Use a batch size that is a multiple of micro_batches={self.k} (micro-batch size x {self.k}).",
            )

        def part(x: Any, i: int) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == rows:
                return x.chunk(self.k, 0)[i]
            if isinstance(x, tuple):
                return tuple(part(y, i) for y in x)
            return x

        outs = []
        for i in range(self.k):
            with self._captured(module, i):
                outs.append(original(*(part(a, i) for a in args), **{n: part(v, i) for n, v in kwargs.items()}))
        if isinstance(outs[0], tuple):
            return tuple(
                torch.cat([o[j] for o in outs], 0) if isinstance(outs[0][j], torch.Tensor) else outs[0][j]
                for j in range(len(outs[0]))
            )
        return torch.cat(outs, 0)

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add the captured per-micro-batch gradients into ``.grad``, in micro-batch order. Note: [ordered gradient sum]."""
        if not self.store:
            return
        order = range(self.k - 1, -1, -1) if self.fault == "reversed_sum" else range(self.k)
        for p in self.params:
            for i in order:
                g = self.store.pop((id(p), i), None)
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g
        self.store.clear()
