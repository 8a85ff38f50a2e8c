"""The LM head's weight in host memory: on the device only while the head's forward or backward runs.

Invariant: the head computes with the same kernels on the same bytes as a resident head; the autograd
graph is the resident graph. Only where the frozen weight waits between uses changes.

Note: [why the head leaves the device]
    The head (vocabulary x hidden, bf16) is the largest resident tensor of a streamed run: 1.09 GB at
    Qwen2.5-7B, 2.49 GB at 72B. It is read twice per step, by the head's forward and by the backward's
    ``grad_hidden = grad_logits @ W``; in between, the loss and its gradient (the fp32 logits) hold the
    device. Keeping the weight in pinned host memory and copying it in for each of the two uses means
    the weight and the fp32 logits are never on the device at the same time.

Note: [the saved weight]
    A linear layer's autograd node saves its weight for the input gradient. Around the head's forward
    a saved-tensor hook replaces any saved view of the device weight by a small record of its geometry;
    when the backward unpacks it, the weight is copied in again and the same view is rebuilt. The graph,
    its nodes and their kernels are those of the resident head (the trick non-reentrant checkpointing
    uses for activations, applied to one frozen weight). Once the node has run, nothing references the
    copy and the allocator reclaims it. Two refinements keep that true: under autocast the weight is cast
    to the autocast dtype when it is copied in (the cast autocast would do, so the same bytes), because
    the layer saves the cast tensor, not the weight; and the views saved by one forward (block-major
    micro-batches save one per micro-batch) share a single copy in the backward.

Note: [prefetch]
    The forward's copy is spread over the last decoder layers' forwards: with ``k`` = head bytes / layer
    bytes, each of the last ``k`` layers queues ``1/k`` of the head on the copy stream behind its block's
    prefetch (:meth:`HostHead.on_layer_forward`). Queued at once, the whole head would hold up the next
    block's copy behind it (one copy stream, one block of prefetch) and stall the compute for about the
    head's copy time; in pieces, the copy stream's work per layer grows by one layer's bytes, which a
    layer's compute hides whenever it takes twice a layer's copy. The weight then occupies the device
    during those layers' forwards, where less is allocated than at the head (no logits yet). The
    backward's copy cannot overlap anything useful (the loss's backward is tiny) and runs when the
    node asks for it: at 55 GB/s a 7B head costs about 20 ms per step, a 72B head 45 ms. With a chunked
    loss, the planner counts the weight away from the layers' forwards; where the budget cannot hold both,
    it turns the spread off (``head_prefetch=False``) and the forward's copy, too, runs when the head asks
    for it: one unhidden copy per step (2.49 GB at 72B: 45 ms of a 17 s step of 16 block-major micro-batches).

Note: [held weight]
    A loss computed in token chunks calls the head once per chunk, in its forward and again in its
    backward (which recomputes each chunk's logits). Copied in per call, the weight would cross the link
    once per chunk and pass. :meth:`HostHead.hold` keeps one device copy for every head call inside it;
    the views those calls save, and the reservations a chunked loss makes for its backward
    (:meth:`HostHead.reserve`), form one group that shares one copy in the backward, as the views of
    block-major micro-batches do. The backward's recompute holds that group's copy (``hold(group)``), so a
    chunked loss costs the copies an unchunked head costs: two per step, or one with ``copies=1``.

Note: [the head's own memory]
    The head's copy is the largest allocation a step makes and frees (1.09 GB at Qwen2.5-7B), once or twice per
    micro-batch. Allocated on the compute stream, its freed memory went to the next smaller allocations of the
    compute stream (a layer's recompute, the boundary gradients), and the next copy found no gap as large as
    itself: at the smallest plans the allocator held 1.0 GB free yet could not place a 1.02 GB head
    (docs/benchmarks/recipes.jsonl, the ``oom_*`` fields). The caching allocator gives a freed block back
    only to the stream that allocated it, so the copy is allocated on the copy stream, where nothing else is
    allocated per step: each copy finds the previous one's memory whole, if that memory is free by then. Marked
    with ``record_stream`` on the compute stream, the forward's copy was not: the host runs ahead of the GPU, and
    the backward's copy was allocated before the GPU had finished the forward's head, so the pool grew to a second
    head, which the compute stream cannot use (docs/planner.md, the head's rows). So a copy this class frees
    itself (the forward's, and any copy once cast under autocast) is freed behind a wait of the copy stream on the
    compute stream (:meth:`HostHead._done`), issued after the copy's last use: the next copy that reuses its
    block writes it only after that use, and a synchronization of the copy stream (the allocator's, before it
    unmaps a cached block under memory pressure) waits for that use too. A copy freed by others (the backward's,
    released by autograd; one kept for the backward) keeps ``record_stream`` (:meth:`HostHead._lend`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from poros_lightning.engine.engine import move_resident
from poros_lightning.errors import PorosConfigError

__all__ = ["HostHead", "check_frozen_head", "check_head_copies"]


def check_frozen_head(module: nn.Module) -> None:
    """Raise :class:`PorosConfigError` unless ``module.weight`` is frozen (it can then wait in host memory)."""
    if module.weight.requires_grad:
        raise PorosConfigError(
            "head_on_host keeps a frozen LM head in host memory, but this head's weight is trained "
            "(modules_to_save, or requires_grad=True).",
            "Drop head_on_host, or leave the LM head's weight out of modules_to_save (LoRA on it is fine).",
        )


def check_head_copies(copies: int) -> None:
    """Raise :class:`PorosConfigError` unless ``copies`` is 1 or 2 (Note: [one copy per step])."""
    if copies not in (1, 2):
        raise PorosConfigError(
            f"head_copies must be 1 or 2, got {copies!r}.",
            "Use head_copies=2 (the weight and the fp32 logits never share the device) or 1 (one copy per step).",
        )


class _Group:
    """The saved views of one head forward: they share one copy of the weight in the backward."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype  # the autocast dtype the forward computed in (None: the weight's own)
        self.pending = 0  # views packed and not unpacked yet
        self.weight: torch.Tensor | None = None  # the backward's copy, while views still need it


@dataclass(frozen=True)
class _HeadView:
    """Where a saved tensor sat inside the head weight's storage."""

    group: _Group
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _autocast_dtype(weight: torch.Tensor, device: torch.device) -> torch.dtype | None:
    """The dtype autocast would cast ``weight`` to in a linear layer, if it would cast it at all."""
    kind = device.type
    if not torch.is_autocast_enabled(kind) or not weight.is_floating_point():
        return None
    dtype = torch.get_autocast_dtype(kind)
    return dtype if dtype != weight.dtype else None


class HostHead:
    """Keeps ``module.weight`` (a frozen, untied LM head) in host memory between uses.

    Args:
        module: the head (an ``nn.Linear``-like module with a frozen ``weight``).
        device: the compute device.
        copy_stream: a CUDA stream for the prefetch copy (``None``: copies run on the compute stream).
        copies: copies of the weight per step: 2 (for the forward and again for the backward) or 1 (the
            forward's copy is kept for the backward; Note: [one copy per step]).
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        copy_stream: torch.cuda.Stream | None = None,
        copies: int = 2,
    ) -> None:
        check_head_copies(copies)
        self.copies = copies
        self.module = module
        self.device = device
        self.copy_stream = copy_stream if device.type == "cuda" else None
        check_frozen_head(module)
        weight = module.weight
        move_resident(module, device, frozenset({id(weight)}))  # a bias, buffers: on the device
        self.host = self._adopt(weight)
        self.loads = 0  # copies issued; tests and benchmarks read it
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._issued = 0  # bytes of the pending copy queued so far (it is complete at self.nbytes)
        self._pieces: dict[int, int] = {}  # layer index -> bytes of the prefetch queued up to it (schedule())
        self._layers: tuple[int, float] | None = None  # schedule()'s arguments
        self._group: _Group | None = None  # the running forward's views
        self._held: tuple[torch.Tensor, _Group] | None = None  # hold(): the device copy and its group
        self._storage: int | None = None  # data_ptr of the device weight the running forward reads
        self._previous = module.__dict__.get("forward")
        self._original = module.forward
        module.forward = self._forward
        module._poros_on_host = True  # resident-part moves skip this module

    def _adopt(self, weight: torch.Tensor) -> torch.Tensor:
        """Make a (pinned) host copy of ``weight``'s bytes the parameter's data between uses."""
        host = weight.detach().to("cpu", copy=True).contiguous()  # copied in byte ranges (Note: [prefetch])
        if self.device.type == "cuda":
            host = host.pin_memory()
        weight.data = host
        self.host = host
        if getattr(self, "_layers", None):
            self.schedule(*self._layers)  # the pieces follow the new size
        return host

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def schedule(self, num_layers: int, layer_bytes: float) -> None:
        """Spread the forward's copy over the last ``ceil(head bytes / layer_bytes)`` of ``num_layers`` layers."""
        self._layers = (num_layers, layer_bytes)
        if self.copy_stream is None or num_layers < 1:
            self._pieces = {}
            return
        k = max(1, min(num_layers, -(-self.nbytes // max(int(layer_bytes), 1))))
        start = num_layers - k
        self._pieces = {start + i: self.nbytes * (i + 1) // k for i in range(k)}

    def on_layer_forward(self, index: int) -> None:
        """Queue this layer's piece of the head's copy (Note: [prefetch])."""
        upto = self._pieces.get(index)
        if upto is not None:
            self.prefetch(upto)

    @torch.no_grad()
    def prefetch(self, upto: int | None = None) -> None:
        """Queue the head's copy on the copy stream, up to byte ``upto`` (default: all of it)."""
        if self.copy_stream is None:
            return
        upto = self.nbytes if upto is None else min(upto, self.nbytes)
        if self._pending is None:
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.copy_stream):  # Note: [the head's own memory]
                dev = torch.empty_like(self.host, device=self.device)
            self._pending, self._issued = (dev, torch.cuda.Event()), 0
            self.loads += 1
            self.copy_stream.wait_stream(compute)  # the copy starts in the compute stream's order
        dev, ready = self._pending
        if upto <= self._issued:
            return
        src, dst = self.host.view(-1).view(torch.uint8), dev.view(-1).view(torch.uint8)
        with torch.cuda.stream(self.copy_stream):
            dst[self._issued : upto].copy_(src[self._issued : upto], non_blocking=True)
            ready.record(self.copy_stream)
        self._issued = upto

    def _copy_now(self) -> torch.Tensor:
        dev = torch.empty_like(self.host, device=self.device)
        dev.copy_(self.host, non_blocking=self.device.type == "cuda")
        self.loads += 1
        return dev

    @torch.no_grad()
    def _fetch(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.copy_stream is not None:
            # What is not queued yet: all of it (head_prefetch=False, the backward's copy) or the pieces a forward
            # that skipped layers left; on the copy stream either way (Note: [the head's own memory]).
            self.prefetch()
            dev, ready = self._pending
        else:
            dev, ready = self._copy_now(), None
        self._pending = None
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        if dtype is None:
            return dev
        # Under autocast a linear layer casts its weight; casting here instead gives the same bytes, and
        # the tensor the layer saves is then a view of this one (Note: [the saved weight]).
        cast = dev.to(dtype)
        self._done()  # the copy is freed on return, once the cast has read it
        return cast

    def _done(self) -> None:
        """The compute stream's uses of the copies issued so far are over: later copy-stream work follows them.

        Called before a copy is freed by this class (Note: [the head's own memory]).
        """
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    def _lend(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` is freed by others (the backward's autograd): not reused before the compute stream's uses of it
        are done (Note: [the head's own memory]); a no-op for memory of the compute stream's own pool."""
        if self.copy_stream is not None:
            weight.record_stream(torch.cuda.current_stream(self.device))
        return weight

    def _pack(self, saved: torch.Tensor) -> Any:
        group = self._group
        if group is not None and saved.untyped_storage().data_ptr() == self._storage:
            group.pending += 1
            return _HeadView(group, tuple(saved.size()), tuple(saved.stride()), saved.storage_offset())
        return saved

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _HeadView):
            return packed
        group = packed.group
        weight = group.weight if group.weight is not None else self._lend(self._fetch(group.dtype))
        group.pending -= 1
        # Views of one forward (block-major micro-batches save one each) share one copy.
        group.weight = weight if group.pending > 0 else None
        return weight.as_strided(packed.size, packed.stride, packed.offset)

    def _readopt(self) -> None:
        weight = self.module.weight
        if weight.data.data_ptr() != self.host.data_ptr():  # replaced since (load_state_dict, .to(dtype))
            self.host = self._adopt(weight)
            self._pending = None  # a prefetch of the old bytes

    def _run(self, dev: torch.Tensor, group: _Group, args: Any, kwargs: Any) -> Any:
        """The head's own forward on ``dev``, its saved views of ``dev`` packed into ``group``."""
        self._group, self._storage = group, dev.untyped_storage().data_ptr()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self._original(*args, **kwargs)
        finally:
            self._group = self._storage = None

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._held is not None:  # Note: [held weight]
            return self._run(*self._held, args, kwargs)
        weight = self.module.weight
        self._readopt()
        group = _Group(_autocast_dtype(self.host, self.device))
        dev = self._fetch(group.dtype)
        weight.data = dev
        try:
            out = self._run(dev, group, args, kwargs)
            if self.copies == 1 and group.pending:
                group.weight = self._lend(dev)  # Note: [one copy per step]
            return out
        finally:
            weight.data = self.host
            self._done()

    @contextlib.contextmanager
    def hold(self, group: _Group | None = None) -> Iterator[_Group]:
        """Keep one device copy of the weight for every call of the head inside (Note: [held weight]).

        Args:
            group: ``None`` in a forward: the weight is fetched as a head forward fetches it, and the group
                yielded collects the calls' saved views and :meth:`reserve` reservations. In a backward that
                recomputes the head, the group a forward's hold yielded and reserved: its backward copy serves
                (fetched if no view fetched it yet), and the reservation is released on exit.

        Yields:
            The group of this hold (inside an enclosing hold: the enclosing one's, and its copy).
        """
        if self._held is not None:
            yield self._held[1]
            return
        weight = self.module.weight
        backward = group is not None
        if group is None:
            self._readopt()
            group = _Group(_autocast_dtype(self.host, self.device))
            dev = self._fetch(group.dtype)
        else:
            dev = group.weight if group.weight is not None else self._lend(self._fetch(group.dtype))
            group.weight = dev  # the recompute's views unpack to it (the reservation keeps pending > 0)
        weight.data = dev
        self._held = (dev, group)
        try:
            yield group
        finally:
            self._held = None
            weight.data = self.host
            if backward:
                group.pending -= 1
                if group.pending == 0:
                    group.weight = None
            elif self.copies == 1 and group.pending:
                group.weight = self._lend(dev)  # Note: [one copy per step]
            else:
                self._done()

    def reserve(self, group: _Group) -> _Group:
        """Count one more backward user of ``group``'s copy (released by ``hold(group)``); returns ``group``."""
        group.pending += 1
        return group

    def detach(self, device: torch.device | str) -> None:
        """Restore the module's forward and give the weight its own memory on ``device``."""
        if self._previous is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self._previous
        if self._pending is not None and self._pending[1] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._pending[1])
        self._pending = None
        self.module.weight.data = self.host.to(device, copy=True)
        self.module.__dict__.pop("_poros_on_host", None)
