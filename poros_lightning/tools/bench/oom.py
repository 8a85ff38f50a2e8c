"""What the caching allocator held when a benchmarked run ran out of memory: the error in one line, and the layout
of its reserved memory (fragmentation, in numbers), taken at the failed allocation itself where torch allows."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["AT_FAILURE", "free_blocks", "oom_line", "watch_oom"]


def oom_line(err: BaseException) -> str:
    """The allocator's message in one line: what it tried to allocate, and what was allocated and reserved."""
    return " ".join(str(err).split())[:600]


def free_blocks() -> dict[str, Any]:
    """How the caching allocator's reserved memory was laid out when a run ran out: fragmentation, in numbers.

    Per segment (``oom_segment_table``): its stream, whether it is expandable, its mapped size, what is allocated
    in it, its free pieces and the largest one (MB), so a reserved-but-unusable figure says where it sits."""
    segments = torch.cuda.memory_snapshot()
    blocks = [b for seg in segments for b in seg["blocks"]]
    table = []
    for seg in segments:
        free = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
        table.append(
            {
                "stream": seg.get("stream"),
                "expandable": seg.get("is_expandable", False),
                "pool": seg.get("segment_type"),
                "mb": round(seg["total_size"] / 2**20, 1),
                "allocated_mb": round(seg["allocated_size"] / 2**20, 1),
                "free_pieces": len(free),
                "largest_free_mb": round(max(free, default=0) / 2**20, 1),
            }
        )
    return {
        "oom_segments": len(segments),
        "oom_expandable": any(seg.get("is_expandable", False) for seg in segments),
        "oom_largest_free_mb": max((b["size"] for b in blocks if b["state"] == "inactive"), default=0) / 2**20,
        "oom_pending_free_mb": sum(b["size"] for b in blocks if b["state"] == "active_pending_free") / 2**20,
        "oom_segment_table": table,
    }


AT_FAILURE: dict[str, Any] = {}
"""The allocator's layout at the failed allocation itself (:func:`watch_oom`), before the step unwound."""


def watch_oom() -> None:
    """Record :func:`free_blocks` the moment an allocation fails: the handler of the run sees memory only after
    the failed step's tensors are freed, which hides the fragmentation that made it fail."""
    if getattr(watch_oom, "attached", False) or not hasattr(torch._C, "_cuda_attach_out_of_memory_observer"):
        return

    def observe(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        AT_FAILURE.clear()
        try:  # an error here would replace the out-of-memory error the run's handler records
            AT_FAILURE.update(free_blocks(), oom_reserved_gb=torch.cuda.memory_reserved() / 1e9)
        except Exception:  # noqa: BLE001
            AT_FAILURE.clear()

    torch._C._cuda_attach_out_of_memory_observer(observe)
    watch_oom.attached = True  # type: ignore[attr-defined]
