"""A ring of device slots that blocks are copied into, with prefetch on a side stream.

Invariants:
- Block ``i`` always lives in the same slot: its own slot when it is one of the first
  ``resident`` blocks (loaded once, never evicted), else ring slot ``(i - resident) % num_slots``: the autograd graph of its forward holds plain
  references into that slot (bitsandbytes keeps the packed weight and quant state as ``ctx``
  attributes, not saved tensors), so the backward must find block ``i``'s bytes at the same addresses.
- A copy into a slot is ordered after every kernel already enqueued on the compute stream (so the
  slot's previous block is no longer read), and compute on a block waits for its copy.
- ``prefetch <= num_slots - 1``: a prefetch never targets the slot of the block being computed.

Note: [the turn]
    The slots remember which block they hold. At the turn from forward to backward the last
    ``num_slots`` blocks are still in place and :meth:`SlotRing.ensure` finds them without copying;
    the same holds from one step's backward (ending at block 0) to the next step's forward.

Note: [synchronous mode]
    Without CUDA streams (CPU, or ``use_streams=False``) the same logic runs with blocking copies, so
    slot reuse, affinity and reloads are exercised by CPU tests.
"""

from __future__ import annotations

import torch

from poros_lightning.engine.store import HostStore
from poros_lightning.errors import PorosOOMError

__all__ = ["SlotRing", "rebind"]


class SlotRing:
    """``num_slots`` flat device buffers that blocks of a :class:`HostStore` are copied into.

    Args:
        store: the host store the blocks come from.
        device: where the slots live.
        num_slots: ring size (>= 2, or 1 when there is a single block).
        prefetch: how many blocks ahead to start copying (<= ``num_slots - 1``).
        use_streams: copy on a side CUDA stream (only on CUDA devices).
        resident: the first ``resident`` blocks get a slot of their own and are copied only once.
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
        self.resident = min(resident, self.num_blocks)
        self.num_slots = num_slots
        self.prefetch = prefetch
        self.use_streams = use_streams and device.type == "cuda"
        self.loads = 0  # copies issued; tests and benchmarks read it
        self.fault: str | None = None  # "wrong_slot": negative control for the parity tests only
        self.timed: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] | None = None  # see time_copies()
        nbytes = store.max_block_bytes
        total = self.resident + (num_slots if self.num_blocks > self.resident else 0)
        try:
            self.slots = [torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device) for _ in range(total)]
        except torch.OutOfMemoryError as err:
            raise PorosOOMError(
                f"Cannot allocate {total} slots of {nbytes / 2**20:.1f} MiB on {device} "
                f"({self.resident} resident blocks + a ring of {num_slots}).",
                "Use a smaller block_size (block_size=1 streams one decoder layer at a time), fewer resident "
                "blocks, or prefetch=1; `poros-lightning check MODEL --vram-budget ...` shows what fits.",
            ) from err
        self.holds = [-1] * total
        if self.use_streams:
            self.copy_stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event() for _ in range(total)]
            self.waited = [True] * total

    def slot_of(self, block: int) -> int:
        if block < self.resident:
            return block
        return self.resident + (block - self.resident) % self.num_slots

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
        step = -1 if backward else 1
        for k in range(1, self.prefetch + 1):
            nxt = block + step * k
            if 0 <= nxt < self.num_blocks and self.holds[self.slot_of(nxt)] != nxt:
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


def rebind(owner: object, attr: str, tensor: torch.Tensor) -> None:
    """Make ``owner.attr`` read ``tensor``'s memory, keeping Parameter objects (and their attributes)."""
    current = getattr(owner, attr)
    if isinstance(current, torch.nn.Parameter):
        current.data = tensor
    else:
        setattr(owner, attr, tensor)
