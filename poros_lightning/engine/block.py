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

Note: [reload at the output's gradient]
    The backward of layer ``j`` begins when the gradient of its output is complete; a hook on that
    output calls :meth:`SlotRing.ensure` for ``j``'s block before any of the layer's backward nodes
    runs. The recompute alone is not enough to order the reload: it starts at the first node that
    unpacks a saved activation, and a frozen 4-bit linear without a LoRA branch (``target_modules``
    without ``down_proj``, say) saves nothing, so its node could read the slot before the compute
    stream waits for the copy. The same hook is what reloads a layer that keeps its activations
    (Note: [kept activations]).

Note: [kept activations]
    With ``keep_activations=n`` the last ``n`` decoder layers run their forward plainly: the graph keeps
    what it saves, and the backward differentiates it without a recompute, after the output hook has
    put the block back in its slot. The kernels, bytes and RNG draws are those of the resident run (the
    recompute of the other layers replays exactly those), so the result is the same; the layers cost one
    forward fewer per step and hold their activations until their backward. Layers that share keys and
    values with a later layer are refused: the later layer's backward reaches the earlier layer's
    projections before that layer's output hook runs.

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
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from poros_lightning.engine.offload import InputOffload
from poros_lightning.engine.slots import SlotRing
from poros_lightning.errors import PorosConfigError

__all__ = ["LayerStreamer"]

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


def _micro_batches_under(original: Callable[..., Any]) -> tuple[Any, nn.Module, Callable[..., Any]] | None:
    """``(splitter, layer, the layer's own forward)`` when ``original`` is a block-major splitter's wrapper."""
    from poros_lightning.engine.microbatch import MicroBatches

    if not isinstance(original, functools.partial):
        return None
    splitter = getattr(original.func, "__self__", None)
    if not isinstance(splitter, MicroBatches) or original.func.__name__ != "_forward" or len(original.args) != 2:
        return None
    module, inner = original.args
    return splitter, module, inner


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
        keep_activations: the last ``keep_activations`` layers keep their activations (no recompute);
            the others drop them in the forward and recompute them in the backward.
    """

    def __init__(self, layers: list[nn.Module], block_of: list[int], ring: SlotRing, keep_activations: int = 0) -> None:
        self.layers = layers
        self.block_of = block_of
        self.ring = ring
        self.keep_from = len(layers) - min(keep_activations, len(layers))  # first layer that keeps them
        self._recomputing = False
        # Called with the layer's index at each layer's forward (not its recompute), after its block's
        # copies are queued: e.g. to queue a piece of the LM head's copy behind them.
        self.on_forward: list[Callable[[int], None]] = []
        # Set by the engine with ``inputs_on_host``: where recomputed layers' inputs wait (engine/offload.py).
        self.inputs: InputOffload | None = None
        self._saved: list[tuple[nn.Module, Any]] = []
        # While the engine times its steps (StreamingEngine.time_steps): one [start, end] pair of CUDA events per
        # forward through the layers (recomputes excluded), on the compute stream.
        self.forward_events: list[list[Any]] | None = None
        # ... and one pair per layer of those forwards, recorded after the wait on its block's copy: the layer's
        # time on the compute stream without the waits (its kernels, or its host's issue where that is longer).
        self.layer_events: list[tuple[Any, Any]] | None = None
        # ... and one pair per layer recompute in the backward, also behind its wait: what a kept layer would skip,
        # host issue included where the host bounds the recompute (Note: [measured plans] in engine/tuner.py).
        self.recompute_events: list[tuple[int, Any, Any]] | None = None

    def _mark(self, index: int, end: bool) -> None:
        events = self.forward_events
        if events is None or self._recomputing:
            return
        if not end and index == 0 and (not events or events[-1][1] is not None):
            events.append([_event(), None])
        elif end and index == len(self.layers) - 1 and events:
            events[-1][1] = _event()  # the outermost call of the last layer ends last (micro-batches nest)
            events[-1].append(len(self.layer_events or ()))  # the layers' pairs this forward closes

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
        if self._recomputing and self.recompute_events is not None:
            start = _event()  # behind the compute stream's wait on the block's reload
            try:  # checkpoint's early stop ends a recompute by raising once it has what the backward needs
                return original(*args, **kwargs)
            finally:
                self.recompute_events.append((index, start, _event()))
        if not self._recomputing:
            for callback in self.on_forward:
                callback(index)
            events = self.layer_events
            if events is not None and torch.is_grad_enabled():
                start = _event()  # behind the compute stream's wait on the block's copy
                out = original(*args, **kwargs)
                events.append((start, _event()))
                return out
        return original(*args, **kwargs)

    def _reload(self, index: int, grad: torch.Tensor) -> None:
        # Note: [reload at the output's gradient]
        self.ring.ensure(self.block_of[index], backward=True)
        if self.inputs is not None and index > 0:
            self.inputs.prefetch(index - 1)  # behind the reload of its block, if that is another one

    def _hook_output(self, index: int, out: Any) -> Any:
        # Every output tensor (hidden states, and whatever else a layer returns) reloads the block.
        reload = functools.partial(self._reload, index)
        for leaf in tree_leaves(out):
            if torch.is_tensor(leaf) and leaf.requires_grad:
                leaf.register_hook(reload)
        return out

    def _forward(self, index: int, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._run(index, original, *args, **kwargs)
        if self.forward_events is None:
            return self._forward_grad(index, original, *args, **kwargs)
        self._mark(index, end=False)
        out = self._forward_grad(index, original, *args, **kwargs)
        self._mark(index, end=True)
        return out

    def _forward_grad(self, index: int, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        split = _micro_batches_under(original)
        if split is not None:  # Note: [one checkpoint per micro-batch] in engine.microbatch
            splitter, module, inner = split
            if not splitter._whole:
                return splitter.run_split(module, functools.partial(self._forward, index, inner), args, kwargs)
        if index >= self.keep_from:  # Note: [kept activations]
            return self._hook_output(index, self._run(index, original, *args, **kwargs))
        for name in _CACHE_KWARGS:
            cache = kwargs.get(name)
            if cache is not None and kwargs.get("use_cache", True):
                raise PorosConfigError(
                    "A KV cache was passed to a streamed layer in a forward that records gradients; the "
                    "recompute in the backward would write to the cache a second time.",
                    "Call the model with use_cache=False when training (prepare() sets config.use_cache=False).",
                )
        offload = (
            torch.autograd.graph.saved_tensors_hooks(functools.partial(self.inputs.pack, index), self.inputs.unpack)
            if self.inputs is not None
            else contextlib.nullcontext()
        )
        with offload:  # sees the inputs checkpoint saves, not the layer's activations (engine/offload.py)
            out = checkpoint(
                self._run,
                index,
                original,
                *args,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=self._contexts,
                **kwargs,
            )
        return self._hook_output(index, out)


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
