"""The host-to-device link, measured on the device the engine streams to.

The planner weighs a block's copy time against a layer's compute time, so it needs the link's real
bandwidth on this card and host (PCIe generation, lanes, NUMA placement), not a nominal figure.
"""

from __future__ import annotations

import time

import torch

__all__ = ["measure_h2d"]


def measure_h2d(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Pinned host-to-device bandwidth in GB/s (1e9 bytes), best of ``repeats``.

    The probe's device buffer is given back to the card (Note: [the probe's segment]).

    Note: [the probe's segment]
        The caching allocator keeps a freed buffer as a cached segment of its size, and the next tensors land in
        it. Measured before expandable segments are switched on (``bench run`` measures the link first), a 1 GiB
        probe left a fixed 1 GiB segment that the model's long-lived tensors then split: on the H100 at 7B,
        16 block-major micro-batches under a 2.02 GB budget, it held 151 MB of them and 873 MB free in pieces,
        which neither the LM head's 1.02 GiB copy could use nor the allocator could return, and the head's
        first copy ran out of memory (docs/benchmarks/recipes.jsonl, ``oom_segment_table``). Emptying the cache
        right after the probe returns the whole segment before anything can split it.
    """
    if not torch.cuda.is_available():
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del src, dst
    torch.cuda.empty_cache()  # Note: [the probe's segment]
    return nbytes / best / 1e9
