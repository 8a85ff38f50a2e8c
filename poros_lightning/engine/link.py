"""The host-to-device link, measured on the device the engine streams to.

The planner weighs a block's copy time against a layer's compute time, so it needs the link's real
bandwidth on this card and host (PCIe generation, lanes, NUMA placement), not a nominal figure.
"""

from __future__ import annotations

import time

import torch

__all__ = ["measure_h2d"]


def measure_h2d(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Pinned host-to-device bandwidth in GB/s (1e9 bytes), best of ``repeats``."""
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
    return nbytes / best / 1e9
