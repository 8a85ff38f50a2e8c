"""Where a step's GPU time goes: one profiled step, summarized per phase from the CUDA timeline.

Invariant: every figure is read from the kernels and copies the profiler recorded; nothing is estimated.

Note: [what the compute stream waits for]
    A phase (``forward``, ``backward``, ``update``; marker kernels on the compute stream bound them) is
    split into the compute stream's busy time and its idle time. Idle time during which a host-to-device
    copy ran on another stream is counted as waiting on the link (``idle_copying_s``); idle time with no
    such copy is the compute stream waiting on something else, almost always the host launching kernels
    (``idle_host_s``). Copies the compute stream runs itself count as busy and, separately, as
    ``compute_copy_s``. A transfer-bound phase shows large ``idle_copying_s``; a launch-bound one large
    ``idle_host_s``.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "MARKER",
    "CudaProfile",
    "KERNEL_GROUPS",
    "kernel_summary",
    "runtime_summary",
    "host_summary",
    "summarize_trace",
    "profile_step",
]

MARKER = "spin_kernel"
"""Name of the kernel ``torch.cuda._sleep`` launches: the phase boundaries of a profiled step."""

_GPU = {"kernel", "gpu_memcpy", "gpu_memset"}


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _clip(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _gaps(busy: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    out, at = [], lo
    for a, b in busy:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


def _h2d(event: dict[str, Any]) -> bool:
    return event.get("cat") == "gpu_memcpy" and "HtoD" in event.get("name", "")


KERNEL_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nf4 dequantize", ("dequantize", "kdequant", "gemm_4bit")),
    ("matmul", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "matmul", "sm80_", "sm90_", "sm100_")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "mem_eff")),
    ("norm, softmax, loss", ("norm", "softmax", "cross_entropy", "nll_loss", "reduce")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "copy_kernel", "fill", "cat", "index")),
)
"""Kernel families of :func:`kernel_summary`, by substrings of the lower-cased kernel name, first match wins; a
kernel matching none is ``other`` (custom Triton kernels such as a peer's fused ones among them: the top kernels
name them), and copies and memsets are ``memcpy``."""


def kernel_summary(trace: dict[str, Any], top: int = 10) -> dict[str, Any]:
    """Where a step's GPU time went, by kernel: ``kernel_groups`` (seconds per family of :data:`KERNEL_GROUPS`,
    every stream, marker kernels left out) and ``top_kernels`` (the ``top`` kernels of most total time, each
    ``{"name", "s", "count"}``, the name cut at 100 characters)."""
    groups: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in _GPU or MARKER in e.get("name", ""):
            continue
        name, seconds = str(e.get("name", "")), float(e.get("dur", 0)) / 1e6
        if e.get("cat") == "kernel":
            low = name.lower()
            group = next((g for g, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other")
        else:
            group = "memcpy"
        groups[group] = groups.get(group, 0.0) + seconds
        entry = by_name.setdefault(name[:100], [0.0, 0])
        entry[0] += seconds
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "kernel_groups": {g: round(t, 6) for g, t in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n, "s": round(t, 6), "count": int(c)} for n, (t, c) in ranked],
    }


def runtime_summary(trace: dict[str, Any], top: int = 12) -> dict[str, Any]:
    """What the host spent inside the CUDA runtime and driver during a step: ``runtime_calls``, the ``top`` API
    calls of most total host time, each ``{"name", "s", "count"}``. Launches show the launch count; a
    synchronization (``cudaStreamSynchronize``, ``cudaEventSynchronize``, a ``cudaMemcpy`` to pageable memory) or an
    allocation (``cudaMalloc``, ``cudaFree``, ``cudaHostAlloc``) shows where the host waited on the GPU or the
    driver instead of running ahead of it."""
    by_name: dict[str, list[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        entry = by_name.setdefault(str(e.get("name", ""))[:100], [0.0, 0])
        entry[0] += float(e.get("dur", 0)) / 1e6
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"runtime_calls": [{"name": n, "s": round(t, 6), "count": int(c)} for n, (t, c) in ranked]}


def host_summary(stats: Any, top: int = 20) -> dict[str, Any]:
    """Where the host's Python time went in a step, from a ``pstats.Stats``: ``host_self`` (the ``top`` functions of
    most time spent in themselves) and ``host_cumulative`` (of most time inside them and what they called), each
    ``{"name", "s", "calls"}`` with ``name`` as ``file:line(function)``, the file shortened to its package path.
    A launch-bound step's extra host time shows here by the function that spends it (profiler overhead included:
    compare rows profiled alike, not seconds against ``s_per_step``)."""

    def name(key: tuple[str, int, str]) -> str:
        file, line, func = key
        for root in ("site-packages/", "poros_lightning/", "lib/python"):
            if root in file:
                file = file[file.index(root) + (len(root) if root != "poros_lightning/" else 0) :]
                break
        return f"{file}:{line}({func})" if line else func

    table = stats.stats  # {key: (primitive calls, calls, self seconds, cumulative seconds, callers)}

    def ranked(column: int) -> list[dict[str, Any]]:
        keys = sorted(table, key=lambda k: -table[k][column])[:top]
        return [{"name": name(k)[:140], "s": round(table[k][column], 6), "calls": int(table[k][1])} for k in keys]

    return {"host_self": ranked(2), "host_cumulative": ranked(3)}


def summarize_trace(
    trace: dict[str, Any], phases: tuple[str, ...] = ("forward", "backward", "update")
) -> dict[str, Any]:
    """Per-phase figures of one step from a Chrome trace (``torch.profiler`` export).

    The step must contain ``len(phases) + 1`` marker kernels (:data:`MARKER`) on its compute stream.
    Returns ``{phase}_{figure}`` keys, seconds unless named otherwise: ``s`` (the phase's length),
    ``busy_s``, ``idle_copying_s``, ``idle_host_s``, ``compute_copy_s`` (Note: [what the compute stream
    waits for]), ``kernels`` (compute-stream kernels), ``side_h2d_s`` and ``side_h2d_gb`` (host-to-device
    copies on other streams, 1e9 bytes), ``d2h_gb`` (device-to-host copies on any stream).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in _GPU]
    markers = sorted(
        (e for e in events if e.get("cat") == "kernel" and MARKER in e.get("name", "")), key=lambda e: e["ts"]
    )
    if len(markers) != len(phases) + 1:
        raise ValueError(f"expected {len(phases) + 1} phase markers in the trace, found {len(markers)}")
    stream = markers[0].get("args", {}).get("stream")
    compute = [e for e in events if e.get("args", {}).get("stream") == stream and MARKER not in e.get("name", "")]
    side = [e for e in events if e.get("args", {}).get("stream") != stream]

    def spans(evs: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
        return _union((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in evs)

    busy_all = spans(compute)
    copy_all = spans(e for e in compute if e.get("cat") == "gpu_memcpy")
    kernel_starts = [float(e["ts"]) for e in compute if e.get("cat") == "kernel"]
    side_h2d = [e for e in side if _h2d(e)]
    side_h2d_all = spans(side_h2d)
    out: dict[str, Any] = {}
    for name, start, end in zip(phases, markers, markers[1:], strict=False):
        lo, hi = float(start["ts"]) + float(start.get("dur", 0)), float(end["ts"])
        busy = _clip(busy_all, lo, hi)
        idle = _gaps(busy, lo, hi)
        copying = _intersect(idle, _clip(side_h2d_all, lo, hi))
        inside = [e for e in events if lo <= float(e["ts"]) < hi]
        out.update(
            {
                f"{name}_s": (hi - lo) / 1e6,
                f"{name}_busy_s": _length(busy) / 1e6,
                f"{name}_idle_copying_s": _length(copying) / 1e6,
                f"{name}_idle_host_s": (_length(idle) - _length(copying)) / 1e6,
                f"{name}_compute_copy_s": _length(_clip(copy_all, lo, hi)) / 1e6,
                f"{name}_kernels": sum(1 for t in kernel_starts if lo <= t < hi),
                f"{name}_side_h2d_s": _length(_clip(side_h2d_all, lo, hi)) / 1e6,
                f"{name}_side_h2d_gb": sum(float(e.get("args", {}).get("bytes", 0)) for e in inside if _h2d(e)) / 1e9,
                f"{name}_d2h_gb": sum(
                    float(e.get("args", {}).get("bytes", 0))
                    for e in inside
                    if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")
                )
                / 1e9,
            }
        )
    return out


class CudaProfile:
    """One step under the CUDA profiler: :meth:`start`, a :meth:`mark` at each phase boundary (four for the
    forward, the backward and the update, the first before the step's first kernel), :meth:`stop`, which
    returns the step's figures (:func:`summarize_trace`, :func:`kernel_summary`, :func:`runtime_summary`). A
    trainer that runs its own steps calls these from its callbacks."""

    def __init__(self) -> None:
        self._prof: Any = None

    @staticmethod
    def mark() -> None:
        """A marker kernel (:data:`MARKER`) on the current stream: a phase boundary."""
        import torch

        torch.cuda._sleep(1)

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self._prof = profile(activities=[ProfilerActivity.CUDA])
        self._prof.__enter__()

    def stop(self) -> dict[str, Any]:
        import torch

        torch.cuda.synchronize()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        return {**summarize_trace(trace), **kernel_summary(trace), **runtime_summary(trace)}


def profile_step(step: Callable[[Callable[[], None]], None]) -> dict[str, Any]:
    """Run ``step(mark)`` once under the CUDA profiler and summarize it (:class:`CudaProfile`); then once more
    under Python's profiler (:func:`host_summary`, its own step: its overhead leaves the CUDA figures alone).

    ``step`` calls ``mark()`` at each phase boundary (four times: before the forward, after it, after
    the backward, after the update); ``mark`` queues a marker kernel on the current stream.
    """
    import cProfile
    import pstats

    import torch

    profiler = CudaProfile()
    profiler.start()
    step(profiler.mark)
    summary = profiler.stop()
    host = cProfile.Profile()
    host.enable()
    step(lambda: None)
    torch.cuda.synchronize()
    host.disable()
    return {**summary, **host_summary(pstats.Stats(host))}
