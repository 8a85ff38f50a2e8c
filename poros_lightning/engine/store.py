"""Host store: every block's frozen bytes in one host allocation per block.

Invariant: after :meth:`HostStore.add_block`, the arena of block ``i`` holds the exact bytes of each
streamed tensor of that block, at the offsets of the block's :class:`Layout`. The arena is written
once and only read afterwards, so any copy of it (into a GPU slot) reproduces the tensors bit for bit.

Note: [one allocation per block]
    Pinning tensor by tensor wastes memory (the pinned caching allocator rounds each request up to a
    power of two) and costs one registration per tensor. Each block gets ONE pageable allocation of
    exactly its size, registered with the driver as page-locked (``cudaHostRegister``), so the
    host footprint is the NF4 size and copies run at the pinned bandwidth.

Note: [arenas from outside]
    An :data:`ArenaFactory` may supply the arenas (e.g. files in shared memory, so that the ranks of
    one host hold one copy of the base). It may report an arena as already holding the block's bytes
    (written by another process that built the same model); the store then skips the copy. Either
    way the arena is pinned in place like an arena of our own.

Note: [unpin before free]
    A registration outlives the memory it covers if the memory is freed first: a prepared model dropped
    without ``unprepare`` would leave its arenas registered, the allocator would hand the same addresses
    out again, and the next ``cudaHostRegister`` over them fails; the failed call's error code then
    surfaces in an unrelated CUDA call later. So the store keeps the addresses it registered and a
    finalizer unregisters them when the store is collected (before its arenas are freed), as
    :meth:`HostStore.release` does explicitly.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from poros_lightning.errors import PorosConfigError, PorosOOMError

__all__ = ["ALIGN", "ArenaFactory", "Entry", "Layout", "HostStore", "tensor_bytes"]

log = logging.getLogger(__name__)

ALIGN = 256
"""Byte alignment of every tensor inside an arena or a slot (enough for any dtype view and for kernels)."""


ArenaFactory = Callable[[int, int], tuple[torch.Tensor, bool]]
"""``(block, nbytes) -> (arena, filled)``: a flat ``uint8`` CPU tensor of at least ``nbytes`` for block
``block``, and whether it already holds the block's bytes (the store then does not copy them)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Entry:
    """One streamed tensor: where its bytes live inside its block's arena (and slot)."""

    owner: object
    attr: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The tensor as a view into ``buffer`` (a flat uint8 arena or slot)."""
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class Layout:
    """The streamed tensors of one block, packed at aligned offsets."""

    entries: tuple[Entry, ...]
    nbytes: int

    @classmethod
    def of(cls, refs: list[tuple[object, str]]) -> Layout:
        entries, offset = [], 0
        for owner, attr in refs:
            t = getattr(owner, attr)
            n = tensor_bytes(t)
            entries.append(Entry(owner, attr, offset, n, t.dtype, tuple(t.shape)))
            offset = _align(offset + n)
        return cls(tuple(entries), offset)


def _ram() -> str:
    try:
        import os

        return f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB"
    except (ValueError, OSError, AttributeError):
        return "unknown"


def _cuda_pin(arena: torch.Tensor) -> bool:
    """Page-lock ``arena`` in place; False when the driver refuses (the copy then runs pageable)."""
    err = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
    return int(err) == 0


def _cuda_unpin(pointers: list[int]) -> None:
    """Unregister every address in ``pointers`` and empty the list (Note: [unpin before free])."""
    if not pointers:
        return
    if torch.cuda.is_available():
        if torch.cuda.is_current_stream_capturing():
            return  # no synchronization is allowed during a capture; the pages stay locked until exit
        torch.cuda.synchronize()  # no copy still reads the arenas
    while pointers:
        torch.cuda.cudart().cudaHostUnregister(pointers.pop())


class HostStore:
    """Per-block host arenas holding the frozen streamed tensors.

    Args:
        layouts: one :class:`Layout` per block.
        pin_memory: page-lock each arena (needs CUDA); without it copies run at pageable speed.
        arena_factory: supplies the arenas instead of plain host allocations (see the Note above).
    """

    def __init__(
        self, layouts: list[Layout], pin_memory: bool = True, arena_factory: ArenaFactory | None = None
    ) -> None:
        self.layouts = layouts
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.arena_factory = arena_factory
        self.arenas: list[torch.Tensor | None] = [None] * len(layouts)
        self._pinned = [False] * len(layouts)
        self._warned = False
        self._registered: list[int] = []  # addresses this store registered, until unregistered
        weakref.finalize(self, _cuda_unpin, self._registered)  # Note: [unpin before free]

    def __deepcopy__(self, memo: dict[int, Any]) -> HostStore:
        # A copy's arenas are new, unpinned memory: it must not unregister the original's addresses.
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            clone.__dict__[key] = copy.deepcopy(value, memo)
        clone._registered = []
        clone._pinned = [False] * len(self.layouts)
        weakref.finalize(clone, _cuda_unpin, clone._registered)
        return clone

    def __len__(self) -> int:
        return len(self.layouts)

    @property
    def max_block_bytes(self) -> int:
        return max((layout.nbytes for layout in self.layouts), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(layout.nbytes for layout in self.layouts)

    @property
    def pinned(self) -> bool:
        return all(self._pinned)

    def _allocate(self, block: int, nbytes: int) -> tuple[torch.Tensor, bool]:
        if self.arena_factory is not None:
            arena, filled = self.arena_factory(block, nbytes)
            if arena.dtype != torch.uint8 or arena.device.type != "cpu" or arena.dim() != 1 or arena.numel() < nbytes:
                raise PorosConfigError(
                    f"The arena factory returned a {arena.dtype} tensor of shape {tuple(arena.shape)} on "
                    f"{arena.device} for block {block}; a flat uint8 CPU tensor of >= {nbytes} bytes is needed.",
                    "Return torch.empty(nbytes, dtype=torch.uint8) or a uint8 view of shared memory of that size.",
                )
            return arena, filled
        try:
            return torch.empty(nbytes, dtype=torch.uint8), False
        except RuntimeError as err:  # the host is out of memory
            raise PorosOOMError(
                f"Cannot allocate {nbytes / 2**20:.1f} MiB of host memory for block {block} "
                f"(the whole base needs {self.total_bytes / 2**30:.2f} GiB).",
                "Free host RAM, or run `poros-lightning check MODEL` to see how much the base needs.",
            ) from err

    @torch.no_grad()
    def fill(self, block: int) -> torch.Tensor:
        """Get block ``block``'s arena and copy its tensors (read from their owners) into it, unless the
        arena factory reports it filled already."""
        layout = self.layouts[block]
        arena, filled = self._allocate(block, max(layout.nbytes, 1))
        if not filled:
            for entry in layout.entries:
                entry.view(arena).copy_(getattr(entry.owner, entry.attr).detach())
        if self.pin_memory and layout.nbytes > 0:
            self._pinned[block] = _cuda_pin(arena)
            if self._pinned[block]:
                self._registered.append(arena.data_ptr())
            if not self._pinned[block] and not self._warned:
                self._warned = True
                log.warning(
                    "Could not page-lock %.1f MiB for block %d (store total %.2f GiB, machine RAM %s); copies of "
                    "unpinned blocks run at pageable speed. Raise the locked-memory limit (ulimit -l) or free RAM.",
                    layout.nbytes / 2**20,
                    block,
                    self.total_bytes / 2**30,
                    _ram(),
                )
        self.arenas[block] = arena
        return arena

    def release(self) -> None:
        """Unpin and drop every arena."""
        _cuda_unpin(self._registered)
        self.arenas = [None] * len(self.layouts)
        self._pinned = [False] * len(self.layouts)
