"""What is on the GPU at a step's peak: one step under the CUDA allocator's history, grouped by where it was allocated.

Invariant: every figure is read from the allocator's own record of the step (``torch.cuda.memory._snapshot()``'s
trace of ``alloc`` and ``free_requested`` events); nothing is estimated. A block counts from its ``alloc`` to its
``free_requested``, as the allocator's ``allocated_bytes`` statistic (``max_memory_allocated``) counts it: a block
freed while a side stream may still use it (``record_stream``) is only reused after that stream's event, and its
``free_completed`` comes later, but it is no longer allocated. The trace gives the sizes asked for; the statistic
counts the blocks the allocator handed out, rounded up, and a large block whose remainder would be 1 MB or less is
not split. So the step's ``max_memory_allocated`` is recorded beside the trace's peak (``max_allocated_gb``): the
difference is what the allocator's block sizes add. Memory allocated before the step and still alive at
the peak is one group (``before the step``): the trace does not say where it came from.

Note: [grouping]
    Each allocation is labelled by the innermost Python frame of the code that asked for it, then the innermost
    frame outside torch where that is another: e.g. ``modeling_qwen2.py:61 forward`` for a norm's fp32 copy,
    ``linear.py:134 forward < chunked_loss.py:120 logits`` for a chunk's logits. Allocations the autograd engine makes outside Python (most of a
    backward's gradients) have no Python frame: they are one group, ``(autograd engine, no Python frame)``. The
    largest groups at the peak are what a memory estimate must count.

Note: [phases]
    The step calls ``mark()`` at each phase boundary (before its forward, after it, after its backward, after its
    update: the bench's step loop does). Each mark allocates one element from :data:`MARKER`, so the boundary is an
    event of the trace itself, in its order, whatever clock the allocator keeps; the replay counts these events,
    leaves them out of the bytes, and names the phase the peak fell in.

Note: [reserved by stream]
    The caching allocator keeps a pool per stream: a block freed by an allocation of one stream is reused only by
    allocations of that stream. What a step reserves beyond what it allocates is then partly free memory of a side
    stream's pool that the compute stream cannot use. :func:`reserved_by_stream` replays the trace's segment events
    (``segment_alloc``/``segment_map`` add, ``segment_free``/``segment_unmap`` take away) and its allocations, per
    stream, from where the step started (the end's ``segments``, less what the trace changed), and reports each
    stream's reserved, allocated and free bytes at the step's reserved peak.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["MARKER", "NO_FRAME", "PHASES", "label", "peak_breakdown", "record_step", "reserved_by_stream"]

NO_FRAME = "(autograd engine, no Python frame)"
MARKER = "_memtrace_phase_marker"
"""The function whose one-element allocation marks a phase boundary in the trace (Note: [phases])."""
PHASES = ("forward", "backward", "update")
BEFORE = "before the step"


def _frame(frame: Mapping[str, Any]) -> str:
    name = str(frame.get("filename", "")).replace(chr(92), "/")
    return f"{name.rsplit('/', 1)[-1]}:{frame.get('line')} {frame.get('name')}"


def label(frames: Iterable[Mapping[str, Any]]) -> str:
    """The innermost Python frame, then the innermost one outside torch if that is another, joined by ``" < "``
    (Note: [grouping])."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]  # innermost first, as recorded
    if not python:
        return NO_FRAME
    parts = [_frame(python[0])]
    for frame in python:
        name = str(frame.get("filename", "")).replace(chr(92), "/")
        if "/torch/" not in name:
            if frame is not python[0]:
                parts.append(_frame(frame))
            break
    return " < ".join(parts)


def _is_marker(event: Mapping[str, Any]) -> bool:
    return event.get("action") == "alloc" and any(f.get("name") == MARKER for f in event.get("frames", ())[:4])


def peak_breakdown(trace: list[Mapping[str, Any]], baseline: int, top: int = 12) -> dict[str, Any]:
    """The allocated peak of ``trace`` (one device's events) over ``baseline`` bytes allocated before it, and what
    was alive there, grouped (Note: [grouping]).

    Returns:
        ``peak_gb`` (allocated at the peak), ``before_gb`` (of it, allocated before the trace), ``events`` (the
        trace's length), ``phase`` (of :data:`PHASES`, the one the peak fell in, when the trace has phase marks;
        else None) and ``top``: the ``top`` largest groups at the peak, each ``{"where", "gb", "count"}``, largest
        first (``before the step`` among them).
    """
    markers: set[int] = set()

    def replay(stop: int | None) -> tuple[int, int, dict[int, tuple[int, str]], int]:
        live: dict[int, tuple[int, str]] = {}
        before = current = peak = baseline
        at = -1
        for i, event in enumerate(trace):
            if stop is not None and i > stop:
                break
            action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
            if _is_marker(event):
                markers.add(addr)
                continue
            if action == "free_requested" and addr in markers:
                markers.discard(addr)
                continue
            if action == "alloc":
                live[addr] = (size, label(event.get("frames", ())) if stop is not None else "")
                current += size
            elif action == "free_requested":
                if addr in live:
                    current -= live.pop(addr)[0]
                else:  # allocated before the trace began
                    before -= size
                    current -= size
            if current > peak:
                peak, at = current, i
        return peak, before, live, at

    peak, _, _, at = replay(None)
    marks = sum(1 for event in trace[: max(at, 0) + 1] if _is_marker(event))
    phase = PHASES[marks - 1] if at >= 0 and 1 <= marks <= len(PHASES) else None
    if at < 0:  # nothing in the trace went above the baseline
        groups: dict[str, list[int]] = {BEFORE: [baseline, 0]}
        before = baseline
    else:
        _, before, live, _ = replay(at)
        groups = {BEFORE: [before, 0]}
        for size, where in live.values():
            entry = groups.setdefault(where, [0, 0])
            entry[0] += size
            entry[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "peak_gb": round(peak / 1e9, 4),
        "before_gb": round(before / 1e9, 4),
        "events": len(trace),
        "phase": phase,
        "top": [{"where": where, "gb": round(b / 1e9, 4), "count": n} for where, (b, n) in ranked],
    }


_GROW = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_USE = {"alloc": 1, "free_requested": -1}


def reserved_by_stream(
    trace: list[Mapping[str, Any]], segments: Iterable[Mapping[str, Any]], compute: int = 0
) -> dict[str, Any]:
    """Each stream's reserved, allocated and free bytes at the trace's reserved peak (Note: [reserved by stream]).

    Args:
        trace: one device's events, each with ``action``, ``size`` and ``stream``.
        segments: that device's segments when the trace ended (``total_size``, ``allocated_size``, ``stream``).
        compute: the compute stream's id (named ``compute``; other streams are ``side 1``, ``side 2``, ... in the
            order they first appear).

    Returns:
        ``reserved_peak_gb`` and ``by_stream``: ``{"stream", "reserved_gb", "allocated_gb", "free_gb"}`` per stream
        at that peak (of its moments, the one with the most allocated), the most free first.
    """
    reserved: dict[int, int] = {}
    allocated: dict[int, int] = {}
    for seg in segments:
        stream = int(seg.get("stream", 0))
        reserved[stream] = reserved.get(stream, 0) + int(seg.get("total_size", 0))
        allocated[stream] = allocated.get(stream, 0) + int(seg.get("allocated_size", 0))
    for event in trace:  # back to the step's start
        stream, size = int(event.get("stream", 0)), int(event.get("size", 0))
        reserved[stream] = reserved.get(stream, 0) - _GROW.get(str(event.get("action")), 0) * size
        allocated[stream] = allocated.get(stream, 0) - _USE.get(str(event.get("action")), 0) * size
    total = [sum(reserved.values()), sum(allocated.values())]
    best = (tuple(total), dict(reserved), dict(allocated))
    names: dict[int, str] = {compute: "compute"}
    for event in trace:  # the peak of reserved; of its moments, the one with the most allocated
        stream, size, action = int(event.get("stream", 0)), int(event.get("size", 0)), str(event.get("action"))
        names.setdefault(stream, f"side {len(names)}")
        grow, use = _GROW.get(action, 0) * size, _USE.get(action, 0) * size
        reserved[stream] = reserved.get(stream, 0) + grow
        allocated[stream] = allocated.get(stream, 0) + use
        total[0] += grow
        total[1] += use
        if tuple(total) > best[0]:
            best = (tuple(total), dict(reserved), dict(allocated))
    for stream in sorted(best[1]):
        names.setdefault(stream, f"side {len(names)}")
    rows = [
        {
            "stream": names[stream],
            "reserved_gb": round(res / 1e9, 4),
            "allocated_gb": round(best[2].get(stream, 0) / 1e9, 4),
            "free_gb": round((res - best[2].get(stream, 0)) / 1e9, 4),
        }
        for stream, res in best[1].items()
        if res
    ]
    return {"reserved_peak_gb": round(best[0][0] / 1e9, 4), "by_stream": sorted(rows, key=lambda r: -r["free_gb"])}


def record_step(step: Callable[[Callable[[], None]], None], max_entries: int = 2_000_000) -> dict[str, Any]:
    """Run ``step(mark)`` once (CUDA) under the allocator's history and return :func:`peak_breakdown` of it.

    ``step`` calls ``mark()`` at its phase boundaries (Note: [phases]). The history holds every allocation and free
    of the step with its Python stack; it is switched off and dropped afterwards.
    """
    import torch

    def _memtrace_phase_marker() -> None:  # the name is MARKER: its allocation is the boundary
        torch.empty(1, device="cuda")

    # The step may reset the peak statistics at its phase boundaries (the bench's step loop does): keep their maximum.
    seen = [0]
    reset = torch.cuda.reset_peak_memory_stats

    def keep_and_reset(*args: Any, **kwargs: Any) -> None:
        seen[0] = max(seen[0], torch.cuda.max_memory_allocated())
        reset(*args, **kwargs)

    torch.cuda.synchronize()
    reset()
    baseline = torch.cuda.memory_allocated()
    device = torch.cuda.current_device()
    torch.cuda.memory._record_memory_history(
        "all", context="alloc", stacks="python", max_entries=max_entries, clear_history=True
    )
    torch.cuda.reset_peak_memory_stats = keep_and_reset
    try:
        step(_memtrace_phase_marker)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.reset_peak_memory_stats = reset
        torch.cuda.memory._record_memory_history(None)
    trace = snapshot["device_traces"][device]
    result = peak_breakdown(trace, baseline)
    segments = [seg for seg in snapshot.get("segments", ()) if seg.get("device", device) == device]
    result.update(reserved_by_stream(trace, segments, torch.cuda.current_stream().cuda_stream))
    result["max_allocated_gb"] = round(max(seen[0], torch.cuda.max_memory_allocated()) / 1e9, 4)
    result["truncated"] = len(trace) >= max_entries  # the history kept only the last max_entries events
    return result
