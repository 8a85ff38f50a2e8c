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
    parameter through :class:`_Capture`, an identity (one per module and chunk, over all its trainable
    parameters) whose backward stores that chunk's gradients and passes nothing on;
    :meth:`MicroBatches.accumulate`, queued by the first capture to run when the
    backward ends (so ``.grad`` is complete for ``on_after_backward`` and for plain loops alike), then adds
    the stored gradients into ``.grad`` in micro-batch order, ``grad = g_1``, ``grad += g_2``, ...,
    exactly the additions layer-major accumulation performs.

Note: [a parameter's sum when its last gradient arrives]
    Stored until the backward ends, the gradients would hold ``k`` copies of every trainable parameter's
    gradient at once: 15 x 537 MB at Qwen2.5-32B (LoRA r16, 16 micro-batches), the 8.2 GB by which the
    smallest block-major plans exceeded their estimates on the H100 (``poros_min_bm16_uncapped`` in
    docs/benchmarks/recipes.jsonl). Each parameter's sum depends on that parameter's gradients only, so the
    forward counts the captures it makes of each parameter, and the backward adds a parameter's gradients into
    ``.grad`` (the same additions, in the same order) as soon as its last capture has run: a decoder layer's
    gradients are summed when its backward is done, and the store holds ``k`` gradients of one layer at a time.
    A capture whose backward never runs (a parameter without a gradient in this graph) leaves its parameter to
    the end of the backward, as before.

Note: [dropout in block-major order] is in :mod:`poros_lightning.engine.dropout_replay`: on CUDA each
    (micro-batch, layer) draws where layer-major accumulation draws.

Note: [one checkpoint per micro-batch]
    A streamed decoder layer recomputes its activations in the backward. The engine's wrapper of the layer
    (``LayerStreamer`` in engine/block.py) finds this splitter under it and checkpoints each micro-batch on its
    own (:meth:`MicroBatches.run_split`, the checkpoint as ``call``): the backward then recomputes and
    differentiates the micro-batches of a layer one after the other (autograd runs the later-created ones
    first), so a layer's recompute holds one micro-batch's activations, not ``k``. The block is loaded once for
    all of them all the same. Each micro-batch's parameter reads go through its capture in the forward; the
    recompute reads the parameters themselves, which saves the same tensors (a capture is a view that saves
    nothing), so the original graph's backward still reaches the captures. The dropout offset is placed before
    each micro-batch's checkpoint, which records the generator's state and restores it for the recompute.

Note: [what block-major cannot reproduce]
    The per-micro-batch loss must be computed by the module (:func:`micro_batches_of` tells it ``k``,
    :func:`micro_batch_sizes` the rows of each); a loss over the whole ``k * b`` batch has another
    normalization. Every micro-batch must have the shapes it has alone: batches padded to a common length
    (``packing`` or ``pad_to_multiple_of=seq_len``), and an attention mask path that does not depend on
    the other micro-batches (``eager`` attention builds the mask for every batch; ``sdpa`` skips it for a
    batch without padding, so a padded neighbour would change the kernel).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from poros_lightning.engine.dropout_replay import DropoutReplay, cuda_generator
from poros_lightning.errors import PorosConfigError

__all__ = [
    "MicroBatches",
    "cuda_generator",
    "dropout_modules",
    "dropout_sources",
    "micro_batch_mean",
    "micro_batch_sizes",
    "micro_batches_of",
    "whole_batches",
]

_ATTR = "_poros_micro_batches"


def micro_batches_of(model: nn.Module) -> int:
    """``k`` when block-major micro-batches are installed on ``model`` (PEFT wrapper or base), else 1."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    found = getattr(base, _ATTR, None)
    return found.k if found is not None else 1


def micro_batch_sizes(model: nn.Module, rows: int) -> list[int]:
    """Rows of each micro-batch of a batch of ``rows`` rows on ``model`` (``[rows]`` when not split)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    found = getattr(base, _ATTR, None)
    return found.sizes(rows) if found is not None else [rows]


def whole_batches(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """A context inside which the split modules of ``model`` run whole (a no-op when none are installed).

    For a caller that already runs one micro-batch at a time: a loss computed in token chunks calls the
    head per chunk of one micro-batch, in its backward too.
    """
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    found = getattr(base, _ATTR, None)
    return found.whole() if found is not None else contextlib.nullcontext()


def micro_batch_mean(
    loss_fn: Callable[..., torch.Tensor], k: int, *tensors: torch.Tensor, sizes: list[int] | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``sum_i loss_fn(micro-batch_i) / k`` over the row chunks of ``tensors``, and the terms.

    Each term is computed as Lightning's gradient accumulation computes it (``loss / k``), so the
    gradients equal those of ``accumulate_grad_batches=k`` over the same micro-batches. ``sizes`` gives
    the rows of each micro-batch (:func:`micro_batch_sizes`; fewer than ``k`` in an epoch's last, short
    batch, as Lightning's last accumulation window); ``k`` equal chunks when ``None``.
    """
    parts = [t.split(sizes, 0) if sizes is not None else t.chunk(k, 0) for t in tensors]
    terms = [loss_fn(*(part[i] for part in parts)) / k for i in range(len(parts[0]))]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total, terms


class _Capture(torch.autograd.Function):
    """Identity on the trainable parameters one module reads in one micro-batch (one node for all of them: the host
    makes one call per module and micro-batch, not one per parameter); the backward stores each incoming gradient
    instead of passing it on."""

    @staticmethod
    def forward(ctx: Any, splitter: MicroBatches, chunk: int, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.splitter, ctx.chunk, ctx.ids = splitter, chunk, tuple(id(p) for p in params)
        ctx.set_materialize_grads(False)  # a parameter this micro-batch did not differentiate: None, not zeros
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        splitter, store, chunk = ctx.splitter, ctx.splitter.store, ctx.chunk
        if not splitter.queued:  # whoever runs this backward, .grad is complete when it returns
            torch.autograd.Variable._execution_engine.queue_callback(splitter.accumulate)
            splitter.queued = True
        done = []
        for pid, grad in zip(ctx.ids, grads, strict=True):
            if grad is None:  # left to the end of the backward, as a capture whose backward never runs
                continue
            key = (pid, chunk)
            if key in store:  # the same micro-batch read the parameter twice: autograd order, as resident
                store[key] = store[key] + grad
            else:
                store[key] = grad
            left = splitter.pending.get(pid, 0) - 1
            splitter.pending[pid] = left
            if left == 0:  # Note: [a parameter's sum when its last gradient arrives]
                done.append(splitter._by_id[pid])
        if done:
            splitter.add_into_grad(*done)
        return (None, None, *(None for _ in grads))


class MicroBatches:
    """Runs the decoder layers, the final norm and the head of ``base`` micro-batch by micro-batch.

    Args:
        base: the Hugging Face causal LM (not the PEFT wrapper).
        modules: the modules to split, in execution order (decoder layers, final norm, LM head).
        k: micro-batches per batch; the batch's first dimension must be a multiple of ``k``.
        layers: how many of ``modules`` (the first ones) are decoder layers.
        body: the module that runs the decoder layers (the decoder stack); with ``rng``, its forward places
            each micro-batch's dropout draws where layer-major accumulation makes them.
        rng: the generator dropout draws from, for a device (:func:`cuda_generator`); it must have
            ``get_offset``/``set_offset`` (Note: [dropout in block-major order]). ``None``: no replay (the
            model must not draw random numbers).
    """

    def __init__(
        self,
        base: nn.Module,
        modules: list[nn.Module],
        k: int,
        *,
        layers: int = 0,
        body: nn.Module | None = None,
        rng: Callable[[torch.device], Any] | None = None,
    ) -> None:
        if k < 2:
            raise PorosConfigError(
                f"micro_batches must be >= 2 to split, got {k}.", "Use micro_batches=1 to turn it off."
            )
        self.base, self.modules, self.k = base, modules, k
        self.params: list[nn.Parameter] = []
        self.store: dict[tuple[int, int], torch.Tensor] = {}
        self.pending: dict[int, int] = {}  # parameter id -> captures made and not yet differentiated
        self._by_id: dict[int, nn.Parameter] = {}
        self._trainable: dict[int, list[tuple[nn.Module, str]]] = {}  # module id -> (owner, name); per backward
        self.fault: str | None = None  # "reversed_sum": negative control for the tests only
        self.queued = False
        self.micro_size: int | None = None  # rows per micro-batch; set from the loader (or the first batch)
        self._whole = False  # whole(): the modules run unsplit
        self._saved: list[tuple[nn.Module, Any]] = []
        if rng is not None and (body is None or layers < 1):
            raise PorosConfigError(
                "Replaying dropout draws in block-major order needs the decoder stack and its layers.",
                "Pass body= and layers= with rng=.",
            )
        self.body = body
        self.replay = DropoutReplay(rng, modules[:layers], self.sizes) if rng is not None else None
        owned: set[int] = set()
        for module in modules:
            for p in module.parameters():
                if p.requires_grad and id(p) not in owned:
                    owned.add(id(p))
                    self.params.append(p)
                    self._by_id[id(p)] = p
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
        if self.replay is not None and self.body is not None:
            self._saved.append((self.body, self.body.__dict__.get("forward")))
            self.body.forward = functools.partial(self._body_forward, self.body.forward)
        setattr(self.base, _ATTR, self)

    def uninstall(self) -> None:
        for module, previous in self._saved:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._saved = []
        self.store.clear()
        self.pending.clear()
        self._trainable.clear()
        if self.replay is not None:
            self.replay.current = None
        self.base.__dict__.pop(_ATTR, None)

    @contextlib.contextmanager
    def _captured(self, module: nn.Module, chunk: int) -> Iterator[None]:
        """Inside ``module``, every trainable parameter is read through a :class:`_Capture` of ``chunk``."""
        # This runs for every layer and micro-batch, on the host, which one-sample micro-batches keep busy: the walk
        # is made once per backward, and the swap writes the module dicts that nn.Module's __setattr__ / __delattr__
        # would (a non-parameter tensor lands in __dict__), without their checks.
        found = self._trainable.get(id(module))
        if found is None:
            found = [
                (owner, name)
                for owner in module.modules()
                for name, p in owner._parameters.items()
                if p is not None and p.requires_grad
            ]
            self._trainable[id(module)] = found
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        try:
            for owner, name in found:
                swapped.append((owner, name, owner._parameters.pop(name)))
            views = _Capture.apply(self, chunk, *(p for _, _, p in swapped)) if swapped else ()
            for (owner, name, p), view in zip(swapped, views, strict=True):
                owner.__dict__[name] = view
                self.pending[id(p)] = self.pending.get(id(p), 0) + 1
            yield
        finally:
            for owner, name, p in swapped:
                owner.__dict__.pop(name, None)
                owner._parameters[name] = p

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Inside, the modules run unsplit (:func:`whole_batches`)."""
        previous, self._whole = self._whole, True
        try:
            yield
        finally:
            self._whole = previous

    def sizes(self, rows: int) -> list[int]:
        """Rows of each micro-batch: ``micro_size`` each, the last one shorter when ``rows`` is not a multiple."""
        if self.micro_size is None:
            if rows % self.k:
                raise PorosConfigError(
                    f"A batch of {rows} rows cannot be split into {self.k} equal micro-batches.",
                    f"Use a batch size that is a multiple of micro_batches={self.k} (micro-batch size x {self.k}).",
                )
            self.micro_size = rows // self.k
        full, rest = divmod(rows, self.micro_size)
        if full + (rest > 0) > self.k:
            raise PorosConfigError(
                f"A batch of {rows} rows holds more than micro_batches={self.k} micro-batches of {self.micro_size}.",
                f"Use batches of at most {self.k * self.micro_size} rows.",
            )
        return [self.micro_size] * full + ([rest] if rest else [])

    def _forward(self, module: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # Evaluation: nothing accumulates, any batch size goes; whole(): the caller splits by micro-batch itself.
        if not torch.is_grad_enabled() or self._whole:
            if self.replay is not None and self.replay.probing:
                return self.replay.probed(module, original, *args, **kwargs)
            return original(*args, **kwargs)
        return self.run_split(module, original, args, kwargs)

    def run_split(self, module: nn.Module, call: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        """``module``'s forward on ``args``/``kwargs`` as its micro-batches, one ``call`` each, outputs concatenated.

        ``call`` is ``module``'s own forward, or (a streamed decoder layer) the engine's checkpoint around it, so that
        each micro-batch is recomputed on its own in the backward (Note: [one checkpoint per micro-batch]).
        """
        original = call
        lead = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        rows = lead.shape[0]
        sizes = self.sizes(rows)
        for name, value in kwargs.items():
            if isinstance(value, dict | list) and value:
                raise PorosConfigError(
                    f"{type(module).__name__} receives shared state in {name!r}, which its micro-batches would "
                    "overwrite in one another.",
                    "Use micro_batches=1 (Trainer(accumulate_grad_batches=k) is exact) for this model.",
                )

        def split(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == rows:
                return list(x.split(sizes, 0))  # one split node per tensor: one gradient buffer in the backward
            if isinstance(x, tuple):
                parts = [split(y) for y in x]
                return [tuple(p[i] if isinstance(p, list) else p for p in parts) for i in range(len(sizes))]
            return x

        def pick(x: Any, i: int) -> Any:
            return x[i] if isinstance(x, list) else x

        split_args = [split(a) for a in args]
        split_kwargs = {n: split(v) for n, v in kwargs.items()}
        outs = []
        placed = self.replay.chunks(module, len(sizes)) if self.replay is not None else contextlib.nullcontext(None)
        with placed as place:  # Note: [dropout in block-major order] (None: nothing to place)
            for i in range(len(sizes)):
                with place(i) if place is not None else contextlib.nullcontext(), self._captured(module, i):
                    outs.append(
                        original(*(pick(a, i) for a in split_args), **{n: pick(v, i) for n, v in split_kwargs.items()})
                    )
        if isinstance(outs[0], tuple):
            return tuple(
                torch.cat([o[j] for o in outs], 0) if isinstance(outs[0][j], torch.Tensor) else outs[0][j]
                for j in range(len(outs[0]))
            )
        return torch.cat(outs, 0)

    def _body_forward(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        assert self.replay is not None
        if not torch.is_grad_enabled() or self._whole:
            return original(*args, **kwargs)
        return self.replay.body_forward(original, *args, **kwargs)

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add the captured per-micro-batch gradients into ``.grad``, in micro-batch order. Note: [ordered gradient sum]."""
        self.queued = False
        self.pending.clear()  # a forward whose graph was not differentiated leaves no count behind
        self._trainable.clear()  # the next forward walks the modules again (requires_grad may change between steps)
        if self.replay is not None:
            self.replay.finish()
        if not self.store:
            return
        self.add_into_grad(*self.params)
        self.store.clear()

    @torch.no_grad()
    def add_into_grad(self, *params: nn.Parameter) -> None:
        """Add each of ``params``' stored gradients into its ``.grad`` in micro-batch order, and drop them.

        Per parameter the additions are those of layer-major accumulation, ``grad = g_1``, ``grad += g_2``, ...; one
        ``torch._foreach_add_`` per micro-batch makes them for all ``params`` at once (the same elementwise sums, in
        the same order, in a few launches instead of one per parameter and micro-batch).
        """
        order = range(self.k - 1, -1, -1) if self.fault == "reversed_sum" else range(self.k)
        grads: list[torch.Tensor | None] = [p.grad for p in params]
        for i in order:
            into, add = [], []
            for j, p in enumerate(params):
                g = self.store.pop((id(p), i), None)
                if g is None:
                    continue
                if grads[j] is None:
                    grads[j] = g
                else:
                    into.append(grads[j])
                    add.append(g)
            if into:
                torch._foreach_add_(into, add)
        for p, g in zip(params, grads, strict=True):
            if g is not None and p.grad is not g:
                p.grad = g


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_CONFIG_DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")


def dropout_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The dropout modules with ``p > 0`` in ``module``, with their qualified names."""
    return [(name, sub) for name, sub in module.named_modules() if isinstance(sub, _DROPOUTS) and sub.p > 0]


def dropout_sources(module: nn.Module) -> list[str]:
    """What draws random numbers in ``module``'s training forward: dropout modules and config dropouts ``> 0``."""
    found = [f"{name} (p={sub.p})" for name, sub in dropout_modules(module)]
    seen: set[int] = set()
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if config is None or isinstance(config, dict) or id(config) in seen:
            continue
        seen.add(id(config))
        for key in _CONFIG_DROPOUTS:
            value = getattr(config, key, 0)
            if isinstance(value, float) and value > 0:
                found.append(f"{name or type(sub).__name__}.config.{key} (p={value})")
    return found
