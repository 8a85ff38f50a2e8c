"""What the data-parallel ranks share: one data order, one host copy of the base, one gradient sum.

The rules are the data-parallel strategy's (:mod:`poros_lightning.lightning.ddp`, Notes [the gather-sum],
[micro-batch order] and [one base per host] there); the pieces that keep them live here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, DistributedSampler
from typing_extensions import override

from poros_lightning.errors import PorosConfigError, PorosOOMError

__all__ = ["MicroBatchSampler", "SHM", "SharedArenas", "gather_sum_gradients"]


SHM = Path("/dev/shm")


class MicroBatchSampler(DistributedSampler):
    """Deals out whole micro-batches: rank ``r``'s ``i``-th batch is global micro-batch ``i * N + r``.

    The global sample order is ``0..n-1``, or with ``shuffle`` the permutation ``DistributedSampler``
    draws (seeded by ``seed + epoch``); ``num_replicas=1`` gives that same order to a single process.
    The order is padded by wrapping around (or, with ``drop_last``, cut) to whole rounds of
    ``num_replicas`` micro-batches, so every rank runs the same number of steps.

    Args:
        dataset: a map-style dataset.
        batch_size: the DataLoader's micro-batch size ``b``.
        num_replicas: number of ranks (default: the process group's size).
        rank: this rank (default: the process group's rank).
        shuffle: permute the samples each epoch.
        seed: permutation seed (the same on every rank).
        drop_last: drop the tail that does not fill a whole round instead of padding it.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        if batch_size < 1:
            raise PorosConfigError(f"batch_size must be >= 1, got {batch_size}.", "Pass the DataLoader's batch_size.")
        self.batch_size = batch_size
        round_size = batch_size * self.num_replicas
        rounds = len(dataset) // round_size if drop_last else math.ceil(len(dataset) / round_size)  # type: ignore[arg-type]
        self.total_size = rounds * round_size
        self.num_samples = rounds * batch_size

    @override
    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=gen).tolist()
        else:
            order = list(range(n))
        while len(order) < self.total_size:  # wrap around, as DistributedSampler pads
            order += order[: self.total_size - len(order)]
        b, world = self.batch_size, self.num_replicas
        for i in range(self.num_samples // b):
            start = (i * world + self.rank) * b
            yield from order[start : start + b]


class SharedArenas:
    """An arena factory (see :data:`~poros_lightning.engine.store.ArenaFactory`) backed by files in shared memory.

    The creator makes ``{prefix}-{block}`` files of exactly the block's size (reserved up front, so a
    full ``/dev/shm`` fails here with a clear error instead of a SIGBUS later) and lets the store copy
    the block into them; the others map the files the creator filled and report them filled.

    Args:
        prefix: path prefix of the files, unique per run and model.
        create: create and fill the files (local rank 0) or map the existing ones.
    """

    def __init__(self, prefix: Path, create: bool) -> None:
        self.prefix = prefix
        self.create = create
        self.paths: list[Path] = []

    def __call__(self, block: int, nbytes: int) -> tuple[torch.Tensor, bool]:
        path = Path(f"{self.prefix}-{block:05d}")
        if self.create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self.paths.append(path)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as err:
                raise PorosOOMError(
                    f"Cannot reserve {nbytes / 2**20:.1f} MiB in {path.parent} for block {block} of the shared base "
                    f"({err.strerror}).",
                    "Enlarge the shared-memory mount (Docker: --shm-size; see `df -h /dev/shm`), or pass "
                    "PorosDDPStrategy(shared_base=False) to give every rank its own copy of the base.",
                ) from err
            finally:
                os.close(fd)
        else:
            size = path.stat().st_size if path.exists() else None
            if size != nbytes:
                raise PorosConfigError(
                    f"Block {block} of the shared base should be {nbytes} bytes in {path}, found "
                    f"{'no file' if size is None else f'{size} bytes'}: the ranks of this host built different models.",
                    "Build the model identically on every rank (same checkpoint and quantization; seed before a "
                    "random init), or pass PorosDDPStrategy(shared_base=False).",
                )
        arena = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        return arena, not self.create

    def unlink(self) -> None:
        """Remove the files; mappings stay valid until the last one goes."""
        for path in self.paths:
            path.unlink(missing_ok=True)
        self.paths = []


@torch.no_grad()
def gather_sum_gradients(params: list[nn.Parameter], held: list[torch.Tensor | None], group: Any = None) -> None:
    """Set each ``p.grad`` to ``held`` plus every rank's ``p.grad``, added in rank order, on every rank.

    This is what ``p.grad`` holds in one process that runs rank 0's backward, then rank 1's, ...: the
    first term is stored (or added onto ``held``), each next one added in place, in ``p``'s dtype.

    Args:
        params: the trainable parameters, in the same order on every rank.
        held: what each ``p.grad`` held before this backward (``None`` after ``zero_grad``).
        group: the process group (default: the world).
    """
    world = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        sizes = [params[i].numel() for i in idx]
        total = sum(sizes)
        # One flat buffer per dtype: the gradients, then one presence flag per tensor (a rank may not
        # have touched a parameter); flags of 0/1 are exact in any floating dtype.
        flat = torch.zeros(total + len(idx), dtype=dtype, device=params[idx[0]].device)
        offset = 0
        for k, (i, n) in enumerate(zip(idx, sizes, strict=True)):
            grad = params[i].grad
            if grad is not None:
                flat[offset : offset + n].copy_(grad.reshape(-1))
                flat[total + k] = 1
            offset += n
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat, group=group)
        present = torch.stack([g[total:] for g in gathered]).cpu() != 0  # [rank, tensor]
        held_here = [held[i] for i in idx]
        if bool(present.all()) and (all(h is None for h in held_here) or all(h is not None for h in held_here)):
            acc = torch.cat([h.reshape(-1) for h in held_here]) if held_here[0] is not None else None
            for part in gathered:
                acc = part[:total] if acc is None else acc.add_(part[:total])
            offset = 0
            for i, n in zip(idx, sizes, strict=True):
                params[i].grad = acc[offset : offset + n].view_as(params[i])
                offset += n
            continue
        offset = 0
        for k, (i, n) in enumerate(zip(idx, sizes, strict=True)):
            grad = held_here[k]
            for rank in range(world):
                if present[rank, k]:
                    term = gathered[rank][offset : offset + n].view_as(params[i])
                    grad = term.clone() if grad is None else grad.add_(term)
            params[i].grad = grad
            offset += n
