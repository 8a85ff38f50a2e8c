"""A shuffling DataLoader whose position in the data order can be saved and restored mid-epoch.

Note: [data position] The training loader's order must be a function of ``(seed, epoch)`` that can start
mid-epoch: :class:`ResumableDataLoader` shuffles with ``torch.Generator().manual_seed(seed + epoch)`` (the
convention of ``DistributedSampler``) and implements Lightning's ``state_dict`` / ``load_state_dict``
protocol, so Lightning hands it the saved position before the first batch is fetched. The position saved is
the number of batches the loop consumed, not the number the loader yielded (the fetcher reads one ahead).
DataLoader workers change nothing: indices are drawn in the main process, and the base seed each iterator
draws for its workers comes from the loader's own generator, never from the global RNG (a persistent-worker
loader draws it once per run, which a resumed run could not repeat).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

__all__ = ["ResumableDataLoader", "ResumableSampler"]


class ResumableSampler(Sampler[int]):
    """A shuffle that is a function of ``(seed, epoch)`` and can start at any sample of the epoch.

    Args:
        num_samples: dataset length.
        seed: base seed; epoch ``e`` uses ``torch.Generator().manual_seed(seed + e)``.
    """

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        self.num_samples, self.seed, self.epoch = num_samples, seed, 0
        self._start = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields (Lightning calls this every epoch)."""
        self.epoch = epoch

    def resume_at(self, epoch: int, start: int) -> None:
        """Make the next iteration yield epoch ``epoch``'s order from sample ``start`` on."""
        self.epoch, self._start = epoch, start

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        yield from order[start:].tolist()

    def __len__(self) -> int:
        return self.num_samples


class ResumableDataLoader(DataLoader):
    """A shuffling ``DataLoader`` whose position Lightning can save and restore (see Note: [data position]).

    Draws nothing from the global RNG. Takes ``DataLoader``'s arguments except ``shuffle``; with an explicit
    ``sampler`` (e.g. a distributed one Lightning injects) it is a plain loader.

    Args:
        dataset: a map-style dataset.
        seed: shuffle seed.
    """

    def __init__(self, dataset: Any, seed: int = 0, sampler: Any = None, generator: Any = None, **kwargs: Any) -> None:
        sampler = ResumableSampler(len(dataset), seed) if sampler is None else sampler
        # The base seed DataLoader draws for its workers comes from this generator, not the global RNG.
        generator = torch.Generator().manual_seed(seed) if generator is None else generator
        super().__init__(dataset, sampler=sampler, generator=generator, **kwargs)
        self.seed = seed

    def state_dict(self) -> dict[str, int]:
        """``{"epoch"}``; :class:`PorosCheckpoint` adds ``"batches"``, the count the loop consumed."""
        return {"epoch": int(getattr(self.sampler, "epoch", 0))}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Start the next iteration after ``batches`` batches of epoch ``epoch``."""
        epoch = int(state_dict["epoch"])
        if "batches" not in state_dict:  # e.g. a Lightning .ckpt: the loader cannot know what the loop consumed
            warnings.warn(
                f"The checkpoint has no data position: epoch {epoch} restarts from its first batch. "
                "Resume from a PorosCheckpoint for an exact mid-epoch resume.",
                stacklevel=2,
            )
        batches = int(state_dict.get("batches", 0))
        if batches >= len(self):  # the epoch was finished: the next one starts from its beginning
            epoch, batches = epoch + 1, 0
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.resume_at(epoch, batches * int(self.batch_size or 1))
