"""A ring of device slots that blocks are copied into, with prefetch on a side stream.

Invariants:
- Block ``i`` always lives in the same slot: its own slot when it is one of the ``resident`` blocks
  (loaded once, never evicted; spread over the model, Note: [resident blocks]), else ring slot
  ``rank % num_slots``, ``rank`` counting the streamed blocks before it: the autograd graph of its forward holds plain
  references into that slot (bitsandbytes keeps the packed weight and quant state as ``ctx``
  attributes, not saved tensors), so the backward must find block ``i``'s bytes at the same addresses.
- A copy into a slot is ordered after every kernel already enqueued on the compute stream (so the
  slot's previous block is no longer read), and compute on a block waits for its copy.
- ``prefetch <= num_slots - 1``: a prefetch never targets the slot of the block being computed.
  While a resident block computes, no ring slot is read, and the ring fills up to ``prefetch + 1`` blocks.

Note: [the turn]
    The slots remember which block they hold. At the turn from forward to backward the last
    ``num_slots`` blocks are still in place and :meth:`SlotRing.ensure` finds them without copying;
    the same holds from one step's backward (ending at block 0) to the next step's forward.

Note: [resident blocks]
    A resident block saves two copies per step. Where it sits decides whether its compute time is also
    copy time: the first blocks (one after the other, at the step's start) run while the ring already
    holds the next streamed blocks, so the copy stream idles through them and the streamed blocks after
    them wait on their copies as if nothing were resident. Spread evenly (the middle of ``resident``
    equal stretches of the model), each resident block's compute lets the copy stream fill the ring
    slot the previous streamed block left: the step's copies run behind all of its compute. On the H200
    at 72B, where the copies bound the step, the forward took 0.72 s with no block resident, 0.62 s with
    the first 22 of 80 resident and 0.48 s with 22 spread (docs/benchmarks.md, "72B: where the time goes").

Note: [synchronous mode]
    Without CUDA streams (CPU, or ``use_streams=False``) the same logic runs with blocking copies, so
    slot reuse, affinity and reloads are exercised by CPU tests.
"""

from __future__ import annotations

import bisect

import torch

from poros_lightning.engine.store import HostStore
from poros_lightning.errors import PorosOOMError

__all__ = ["SlotRing", "rebind", "resident_positions"]


class SlotRing:
    """``num_slots`` flat device buffers that blocks of a :class:`HostStore` are copied into.

    Args:
        store: the host store the blocks come from.
        device: where the slots live.
        num_slots: ring size (>= 2, or 1 when there is a single block).
        prefetch: how many blocks ahead to start copying (<= ``num_slots - 1``).
        use_streams: copy on a side CUDA stream (only on CUDA devices).
        resident: this many blocks, spread over the model (:func:`resident_positions`), get a slot of their
            own and are copied only once.
    """

    def __init__(
        self,
        store: HostStore,
        device: torch.device,
        num_slots: int,
        prefetch: int,
        use_streams: bool = True,
        resident: int = 0,
    ) -> None:
        self.store = store
        self.device = device
        self.num_blocks = len(store)
        self.num_slots = num_slots
        self.prefetch = prefetch
        self.use_streams = use_streams and device.type == "cuda"
        self.loads = 0  # copies issued; tests and benchmarks read it
        self.fault: str | None = None  # "wrong_slot": negative control for the parity tests only
        self.timed: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] | None = None  # see time_copies()
        if self.use_streams:
            self.copy_stream = torch.cuda.Stream(device)
        self.slots: list[torch.Tensor] = []
        self._place(resident)

    def _place(self, resident: int) -> None:
        """Give ``resident`` blocks (spread over the model) a slot of their own, the rest the ring; no block held."""
        self.resident = min(max(resident, 0), self.num_blocks)
        self.resident_at = resident_positions(self.num_blocks, self.resident)
        own = set(self.resident_at)
        self.streamed = [b for b in range(self.num_blocks) if b not in own]  # in order
        self._slot = [0] * self.num_blocks
        for slot, block in enumerate(self.resident_at):
            self._slot[block] = slot
        for rank, block in enumerate(self.streamed):
            self._slot[block] = self.resident + rank % max(self.num_slots, 1)
        self._rank = {block: rank for rank, block in enumerate(self.streamed)}
        nbytes = self.store.max_block_bytes
        total = self.resident + (self.num_slots if self.num_blocks > self.resident else 0)
        del self.slots[total:]  # every slot has the same size: keep what is there, add what is missing
        try:
            while len(self.slots) < total:
                self.slots.append(torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device))
        except torch.OutOfMemoryError as err:
            raise PorosOOMError(
                f"Cannot allocate {total} slots of {nbytes / 2**20:.1f} MiB on {self.device} "
                f"({self.resident} resident blocks + a ring of {self.num_slots}).",
                "Use a smaller block_size (block_size=1 streams one decoder layer at a time), fewer resident "
                "blocks, or prefetch=1; `poros-lightning check MODEL --vram-budget ...` shows what fits.",
            ) from err
        self.holds = [-1] * total
        if self.use_streams:
            self.ready = [torch.cuda.Event() for _ in range(total)]
            self.waited = [True] * total

    def set_resident(self, resident: int, num_slots: int | None = None) -> None:
        """Keep ``resident`` blocks on the device (and a ring of ``num_slots``) from the next step on.

        No autograd graph may be alive: a graph holds references into the slots its blocks were in, and the
        blocks move. Every block is bound to its new slot and copied again when first needed; the bytes are the
        host store's either way, so the result does not change (Note: [resident blocks]).
        """
        if self.use_streams:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        if num_slots is not None:
            self.num_slots = num_slots
        self._place(resident)
        for block in range(self.num_blocks):
            self.bind(block)

    def slot_of(self, block: int) -> int:
        return self._slot[block]

    def bind(self, block: int) -> None:
        """Point every streamed tensor of ``block`` at its view inside the block's slot."""
        slot = self.slots[self.slot_of(block)]
        for entry in self.store.layouts[block].entries:
            rebind(entry.owner, entry.attr, entry.view(slot))

    def _copy(self, block: int, slot: int) -> None:
        arena = self.store.arenas[block]
        n = self.store.layouts[block].nbytes
        if self.use_streams:
            # Everything enqueued on the compute stream so far includes the last use of this slot.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                if self.timed is not None:
                    begin = torch.cuda.Event(enable_timing=True)
                    begin.record(self.copy_stream)
                self.slots[slot][:n].copy_(arena[:n], non_blocking=True)
                self.ready[slot].record(self.copy_stream)
                if self.timed is not None:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(self.copy_stream)
                    self.timed.append((begin, end, n))
            self.waited[slot] = False
        else:
            self.slots[slot][:n].copy_(arena[:n])
        self.loads += 1

    def _load(self, block: int, backward: bool = False) -> None:
        slot = self.slot_of(block)
        if self.fault == "wrong_slot" and backward:
            # Negative control: the bytes land in the next slot while the bookkeeping believes they
            # are in their own; the graph then reads another block's bytes in the backward.
            self._copy(block, self.slot_of(block + 1))
        else:
            self._copy(block, slot)
        self.holds[slot] = block

    @torch.no_grad()
    def ensure(self, block: int, backward: bool = False) -> None:
        """Make block ``block`` computable: load it if its slot holds another block, then prefetch.

        Args:
            block: the block about to be computed (forward) or recomputed (backward).
            backward: direction of the prefetch (``block - 1, ...`` in the backward).
        """
        slot = self.slot_of(block)
        if self.holds[slot] != block:
            self._load(block, backward)
        if self.use_streams and not self.waited[slot]:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
            self.waited[slot] = True
        # The next streamed blocks in the direction of travel (resident ones need no copy).
        rank = self._rank.get(block)
        if rank is None:  # a resident block computes: every ring slot is free to fill
            ahead = min(self.prefetch + 1, self.num_slots)
            rank = bisect.bisect_left(self.streamed, block) - (1 if not backward else 0)
        else:
            ahead = self.prefetch
        for k in range(1, ahead + 1):
            nxt_rank = rank - k if backward else rank + k
            if 0 <= nxt_rank < len(self.streamed):
                nxt = self.streamed[nxt_rank]
                if self.holds[self.slot_of(nxt)] != nxt:
                    self._load(nxt, backward)

    def time_copies(self, enable: bool = True) -> None:
        """Start (or stop) timing every copy with CUDA events on the copy stream; see :meth:`copy_stats`."""
        self.timed = [] if enable and self.use_streams else None

    def copy_stats(self) -> dict[str, float]:
        """Bytes copied and seconds the copy stream spent copying since :meth:`time_copies` (synchronizes).

        ``gbps`` is the bandwidth the copies achieved while they ran (bytes / summed copy time, 1e9 bytes).
        """
        if not self.timed:
            return {"copies": 0, "bytes": 0, "seconds": 0.0, "gbps": 0.0}
        self.timed[-1][1].synchronize()
        seconds = sum(begin.elapsed_time(end) for begin, end, _ in self.timed) / 1e3
        nbytes = sum(n for _, _, n in self.timed)
        return {"copies": len(self.timed), "bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9}

    def release(self) -> None:
        """Wait for pending copies and free the slots."""
        if self.use_streams:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self.slots = []
        self.holds = [-1] * len(self.holds)


def resident_positions(num_blocks: int, resident: int) -> list[int]:
    """The blocks that stay resident: the middle of ``resident`` equal stretches (Note: [resident blocks])."""
    resident = min(max(resident, 0), num_blocks)
    return [(2 * k + 1) * num_blocks // (2 * resident) for k in range(resident)]


def rebind(owner: object, attr: str, tensor: torch.Tensor) -> None:
    """Make ``owner.attr`` read ``tensor``'s memory, keeping Parameter objects (and their attributes)."""
    current = getattr(owner, attr)
    if isinstance(current, torch.nn.Parameter):
        current.data = tensor
    else:
        setattr(owner, attr, tensor)
