"""StreamingEngine: the frozen base of a list of decoder layers streamed through a device slot ring.

Invariant: while attached, every streamed tensor of layer ``j`` is a view into the slot of block
``j // block_size``; its true bytes live in the host store; every other tensor of the layers
(adapters, norms, biases, small quantization tables) is resident on the device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from poros_lightning._logging import log_count
from poros_lightning.engine.block import LayerStreamer
from poros_lightning.engine.offload import InputOffload
from poros_lightning.engine.slots import SlotRing, rebind
from poros_lightning.engine.store import ArenaFactory, HostStore, Layout
from poros_lightning.errors import PorosConfigError

log = logging.getLogger(__name__)

__all__ = ["EngineOptions", "StreamingEngine", "move_resident"]


@dataclass(frozen=True)
class EngineOptions:
    """Options of the streaming engine.

    Attributes:
        block_size: consecutive decoder layers copied together (the unit of streaming).
        prefetch: blocks copied ahead of the one computing (forward: ``i+1..``, backward: ``i-1..``).
        num_slots: device slots in the ring; ``None`` means ``prefetch + 1``, the minimum.
        pin_memory: page-lock the host store (CUDA only) for full-bandwidth asynchronous copies.
        use_streams: copy on a side CUDA stream; ``False`` runs the synchronous path (always on CPU).
        keep_activations: the last ``keep_activations`` decoder layers keep their activations from the
            forward to the backward instead of recomputing them (exact; one forward fewer per layer and
            step, for the memory of their activations). A number >= the layer count keeps them all.
        resident_blocks: this many blocks, spread over the model, get a device slot of their own and are
            copied once (fewer copies per step when memory allows; Note: [resident blocks] in slots.py).
        inputs_on_host: the input each recomputing layer saves for its recompute (its hidden state) waits
            in pinned host memory between the forward and the backward (exact; two copies of it per step,
            on side streams; see engine/offload.py).
    """

    block_size: int = 1
    prefetch: int = 1
    num_slots: int | None = None
    pin_memory: bool = True
    use_streams: bool = True
    keep_activations: int = 0
    resident_blocks: int = 0
    inputs_on_host: bool = False

    def validate(self, num_layers: int) -> EngineOptions:
        if self.block_size < 1:
            raise PorosConfigError(f"block_size must be >= 1, got {self.block_size}.", "Use block_size=1 or more.")
        if self.resident_blocks < 0:
            raise PorosConfigError(
                f"resident_blocks must be >= 0, got {self.resident_blocks}.", "Use resident_blocks=0 (default) or more."
            )
        if self.keep_activations < 0:
            raise PorosConfigError(
                f"keep_activations must be >= 0, got {self.keep_activations}.",
                "Use keep_activations=0 (recompute every layer, the default) or the number of last layers to keep.",
            )
        if self.prefetch < 1:
            raise PorosConfigError(f"prefetch must be >= 1, got {self.prefetch}.", "Use prefetch=1 (default) or more.")
        num_blocks = -(-num_layers // self.block_size)
        resident = min(self.resident_blocks, num_blocks)
        slots = self.num_slots if self.num_slots is not None else self.prefetch + 1
        slots = min(slots, max(num_blocks - resident, 1))
        streamed = num_blocks - resident
        if streamed > 1 and slots < self.prefetch + 1 and slots < streamed:
            raise PorosConfigError(
                f"num_slots={self.num_slots} cannot hold the computing block plus prefetch={self.prefetch} blocks.",
                f"Use num_slots >= {self.prefetch + 1} or a smaller prefetch.",
            )
        keep = min(self.keep_activations, num_layers)
        return EngineOptions(
            **{**asdict(self), "num_slots": slots, "resident_blocks": resident, "keep_activations": keep}
        )


def move_resident(module: nn.Module, device: torch.device, streamed: set[int] | frozenset[int] = frozenset()) -> None:
    """Move every parameter and buffer of ``module`` to ``device`` in place, keeping Parameter objects.

    Skips tensors whose ``id`` is in ``streamed`` and modules marked ``_poros_on_host`` (kept in host
    memory on purpose, e.g. an input embedding table).
    """
    for sub in module.modules():
        if getattr(sub, "_poros_on_host", False):
            continue
        for param in sub._parameters.values():
            if param is not None and id(param) not in streamed and param.device != device:
                param.data = param.data.to(device)
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.device != device:
                sub._buffers[name] = buf.to(device)


class StreamingEngine:
    """Streams the frozen tensors of ``layers`` from host memory through device slots.

    Args:
        layers: the decoder layers in execution order.
        refs: for each layer, ``(owner, attribute)`` pairs naming its frozen tensors to stream.
        device: the compute device.
        options: engine options.
        arena_factory: supplies the host arenas of the blocks (e.g. shared memory); plain host
            allocations when ``None``. See :class:`~poros_lightning.engine.store.HostStore`.
    """

    def __init__(
        self,
        layers: list[nn.Module],
        refs: list[list[tuple[object, str]]],
        device: torch.device | str,
        options: EngineOptions | None = None,
        *,
        arena_factory: ArenaFactory | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._requested = options or EngineOptions()
        self.options = self._requested.validate(len(layers))
        self.layers = list(layers)
        bs = self.options.block_size
        self.block_of = [j // bs for j in range(len(layers))]
        block_refs: list[list[tuple[object, str]]] = [[] for _ in range(-(-len(layers) // bs))]
        for j, layer_refs in enumerate(refs):
            block_refs[self.block_of[j]].extend(layer_refs)
        self.store = HostStore(
            [Layout.of(r) for r in block_refs], pin_memory=self.options.pin_memory, arena_factory=arena_factory
        )
        self.ring = SlotRing(
            self.store,
            self.device,
            num_slots=self.options.num_slots,
            prefetch=self.options.prefetch,
            use_streams=self.options.use_streams,
            resident=self.options.resident_blocks,
        )
        streamed = {id(getattr(o, a)) for r in refs for o, a in r}
        start = time.perf_counter()
        for block in range(len(self.store)):
            self.store.fill(block)
            self.ring.bind(block)  # drops the last reference to the original tensors
            log_count(log, "poros: copying blocks into the host store", block + 1, len(self.store), start)
        for layer in self.layers:
            move_resident(layer, self.device, streamed)
        self.streamer = LayerStreamer(
            self.layers, self.block_of, self.ring, keep_activations=self.options.keep_activations
        )
        if self.options.inputs_on_host:
            self.streamer.inputs = InputOffload(self.device, self.ring.copy_stream if self.ring.use_streams else None)
        self.streamer.install()
        self.host_embedding: Any = None  # set by prepare(): modules kept in host memory
        self.host_head: Any = None

    @property
    def num_blocks(self) -> int:
        return len(self.store)

    def set_keep_activations(self, keep_activations: int) -> None:
        """Let the last ``keep_activations`` layers keep their activations from the next forward on.

        Call it between steps, with no autograd graph of this model alive: each layer decides in its forward
        whether to recompute, and a graph already built keeps the choice it was built with. Any value gives
        the same bits (Note: [kept activations] in block.py), so a run may change it from one step to the next.
        """
        if keep_activations < 0:
            raise PorosConfigError(
                f"keep_activations must be >= 0, got {keep_activations}.", "Use 0 (recompute every layer) or more."
            )
        keep = min(keep_activations, len(self.layers))
        self.streamer.keep_from = len(self.layers) - keep
        self.options = replace(self.options, keep_activations=keep)

    def set_resident_blocks(self, resident_blocks: int) -> None:
        """Keep ``resident_blocks`` blocks on the device from the next step on (Note: [resident blocks]).

        Call it between steps, with no autograd graph of this model alive. The blocks are the host store's bytes
        wherever they sit, so a run may change it from one step to the next without changing a bit.
        """
        if resident_blocks < 0:
            raise PorosConfigError(
                f"resident_blocks must be >= 0, got {resident_blocks}.", "Use 0 (stream every block) or more."
            )
        options = replace(self.options, resident_blocks=resident_blocks, num_slots=self._requested.num_slots).validate(
            len(self.layers)
        )
        self.ring.set_resident(options.resident_blocks, options.num_slots)
        self.options = options

    def time_steps(self, enable: bool = True) -> None:
        """Start (or stop) timing, on the device, each block copy and each forward through the layers (CUDA)."""
        on = enable and self.ring.use_streams
        self.ring.time_copies(on)
        self.streamer.forward_events = [] if on else None
        self.streamer.layer_events = [] if on else None
        self.streamer.recompute_events = [] if on else None

    def timings(self) -> dict[str, float]:
        """Seconds per block copy, and per block of a forward through the layers, since :meth:`time_steps`.

        Synchronizes. ``block_forward_s`` is the device time of a forward through the layers over the number of
        blocks, waits on copies included: where the copies bound the step it is about a copy's time, where
        compute or launches bound it, longer. ``compute_s`` is the same forward without the waits: each layer
        timed from behind its wait on its block's copy (Note: [measured plans] in engine/tuner.py).
        ``recompute_s`` is the backward's recompute of one layer, per forward, timed the same way: what a kept
        layer skips (0.0 where no layer recomputed).
        """
        copies = self.ring.copy_stats()
        events = [pair for pair in self.streamer.forward_events or [] if pair[1] is not None]
        if events:
            events[-1][1].synchronize()  # and every layer's pair before it, on the same stream
        forward = sum(pair[0].elapsed_time(pair[1]) for pair in events) / 1e3
        closed = (self.streamer.layer_events or [])[: events[-1][2] if events else 0]  # not an unfinished forward's
        compute = sum(a.elapsed_time(b) for a, b in closed) / 1e3
        recomputes = self.streamer.recompute_events or []
        if recomputes:
            recomputes[-1][2].synchronize()
        recomputed = len({index for index, _, _ in recomputes}) * len(events)
        recompute = sum(a.elapsed_time(b) for _, a, b in recomputes) / 1e3
        per_block = len(events) * self.num_blocks
        return {
            "copy_s": copies["seconds"] / copies["copies"] if copies["copies"] else 0.0,
            "block_forward_s": forward / per_block if events else 0.0,
            "compute_s": compute / per_block if events else 0.0,
            "recompute_s": recompute / recomputed if recomputed else 0.0,
        }

    def detach(self, device: torch.device | str | None = None, *, copy: bool = True) -> None:
        """Give every streamed tensor its own memory on ``device`` again and unwrap the layers.

        With ``copy=False`` (``device`` must be the CPU) the tensors become views into the host arenas
        instead: no new memory, and an arena shared with other processes stays shared.
        """
        target = torch.device(device) if device is not None else self.device
        if not copy and target.type != "cpu":
            raise PorosConfigError(
                f"detach(copy=False) keeps the base in its host arenas; it cannot target {target}.",
                "Pass device='cpu' with copy=False, or copy=True to give the base new memory on the device.",
            )
        self.streamer.uninstall()
        self.ring.release()
        for block, layout in enumerate(self.store.layouts):
            arena = self.store.arenas[block]
            for entry in layout.entries:
                view = entry.view(arena)
                rebind(entry.owner, entry.attr, view.to(target, copy=True) if copy else view)
        self.store.release()
