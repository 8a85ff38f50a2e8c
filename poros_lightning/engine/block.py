"""Graph-preserving recompute of streamed decoder layers.

Invariant: the backward of a layer sees the same RNG state and the same weight bytes as its forward.

Note: [graph-preserving recompute]
    Each decoder layer's forward runs under non-reentrant :func:`torch.utils.checkpoint.checkpoint`:
    the autograd graph is built exactly as in a resident run (grad enabled, the same ops), only the
    activations it saves are dropped (saved-tensor hooks). The backward reruns the layer to refill
    them, under the CPU and device RNG state captured before the original forward, and then walks the
    ORIGINAL graph. Rebuilding the graph in the backward (reentrant checkpointing, or an
    ``autograd.Function`` that recomputes and calls ``autograd.grad``) is not bit-exact: the
    gradients of the frozen-weight matmuls come out different.

Note: [reload before recompute]
    Nodes of the original graph keep plain references to the weight bytes they read (bitsandbytes
    stores the packed weight and its quant state on ``ctx``). So the recompute first calls
    :meth:`SlotRing.ensure`, which copies the block back into the SAME slot (block ``i`` -> slot
    ``i % S``) in place. Reloading elsewhere leaves the graph reading another block's bytes: the loss
    stays exact and the gradients go wrong (the ``wrong_slot`` negative control tests exactly this).

Note: [layers stay where they are]
    The decoder layers are not moved or renamed: each layer's ``forward`` is wrapped in place, so the
    model's module tree, ``state_dict`` keys and PEFT adapter names are those of the resident model.
    A *block* (``block_size`` consecutive layers) is the unit of copying; the layer is the unit of
    recompute, which keeps the recompute working set to one layer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from poros_lightning.engine.slots import SlotRing
from poros_lightning.errors import PorosConfigError

__all__ = ["LayerStreamer"]

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


class _Recomputing:
    """Marks the streamer as recomputing while entered; re-entrant, unlike a generator context."""

    def __init__(self, streamer: LayerStreamer) -> None:
        self.streamer = streamer

    def __enter__(self) -> None:
        self.streamer._recomputing = True

    def __exit__(self, *exc: object) -> None:
        self.streamer._recomputing = False


class LayerStreamer:
    """Wraps the forward of each decoder layer so it runs through the slot ring.

    Args:
        layers: the decoder layers, in execution order.
        block_of: block index of each layer.
        ring: the slot ring holding the blocks.
        recompute: drop activations in the forward and recompute them in the backward.
    """

    def __init__(self, layers: list[nn.Module], block_of: list[int], ring: SlotRing, recompute: bool = True) -> None:
        self.layers = layers
        self.block_of = block_of
        self.ring = ring
        self.recompute = recompute
        self._recomputing = False
        self.after_last_forward: Callable[[], None] | None = None  # e.g. start copying the LM head
        self._saved: list[tuple[nn.Module, Any]] = []

    def install(self) -> None:
        """Wrap every layer's forward (idempotent per engine)."""
        for index, layer in enumerate(self.layers):
            previous = layer.__dict__.get("forward")
            self._saved.append((layer, previous))
            original = layer.forward
            layer.forward = functools.partial(self._forward, index, original)

    def uninstall(self) -> None:
        """Restore every layer's original forward."""
        for layer, previous in self._saved:
            if previous is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = previous
        self._saved = []

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        # The recompute context is entered once per backward that reaches the layer (twice with retain_graph).
        return contextlib.nullcontext(), _Recomputing(self)

    def _run(self, index: int, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.ring.ensure(self.block_of[index], backward=self._recomputing)
        if index == len(self.layers) - 1 and not self._recomputing and self.after_last_forward is not None:
            self.after_last_forward()
        return original(*args, **kwargs)

    def _forward(self, index: int, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not (self.recompute and torch.is_grad_enabled()):
            return self._run(index, original, *args, **kwargs)
        for name in _CACHE_KWARGS:
            cache = kwargs.get(name)
            if cache is not None and kwargs.get("use_cache", True):
                raise PorosConfigError(
                    "A KV cache was passed to a streamed layer in a forward that records gradients; the "
                    "recompute in the backward would write to the cache a second time.",
                    "Call the model with use_cache=False when training (prepare() sets config.use_cache=False).",
                )
        return checkpoint(
            self._run,
            index,
            original,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=self._contexts,
            **kwargs,
        )
