"""The seconds Python's garbage collector runs, so that a measured step can leave them out.

Note: [the collector's time]
A collection runs on the host thread that issues the step's kernels, whenever enough container objects were
allocated; on a step bound by the host, the device waits for it. What triggers a collection, and what a full one
scans, is the process's objects, not the plan: the same plan's steps differ by whether a full collection fell in
them. At Qwen2.5-72B, seq 512, on the H100, the bench's unfrozen process made one full collection in three timed
steps of 1.17-2.15 s, and the collector took 0.37-0.46 s of those three steps in all; in the one row whose three
steps held no full collection, 0.03 s (gc_s_per_step, gc_full_per_step: planner_sweep.jsonl, run
2026-12-07T21:44:59). A full collection, some 0.4 s, in one of a tuner's steps makes a 1.6 s plan time about 25%
slower. The tuner times each step less what the collector took in it (engine/tuner.py, Note: [measured
plans]). Where the device bounds a step, a collection can hide behind kernels already queued, and the step timed
less it reads faster than it ran, by at most the collection's seconds: an error no larger than the one it
removes where the host bounds the step. ``PorosStrategy(gc_freeze=True)`` makes each full collection cheaper
(lightning/collector.py, Note: [frozen setup]); it does not stop them.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

__all__ = ["CollectorClock"]


class CollectorClock:
    """Seconds of Python's collections between ``start`` and ``stop``; calling it reads them (every generation).

    ``counts`` and ``by_generation`` hold the collections and their seconds per generation (2: the full ones, which
    scan every tracked object). The hook is one entry of ``gc.callbacks`` while started; it holds no reference to
    whoever reads the clock.
    """

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.by_generation = [0.0, 0.0, 0.0]
        self._began: float | None = None
        self._on = False

    @property
    def seconds(self) -> float:
        return sum(self.by_generation)

    @property
    def collections(self) -> int:
        return sum(self.counts)

    def _hook(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None and 0 <= info.get("generation", -1) <= 2:
            self.counts[info["generation"]] += 1
            self.by_generation[info["generation"]] += time.perf_counter() - self._began
            self._began = None

    def start(self) -> CollectorClock:
        if not self._on:
            gc.callbacks.append(self._hook)
            self._on = True
        return self

    def stop(self) -> None:
        if self._on:
            with contextlib.suppress(ValueError):  # someone cleared gc.callbacks
                gc.callbacks.remove(self._hook)
            self._on = False
            self._began = None

    def __call__(self) -> float:
        return self.seconds

    def __getstate__(self) -> dict[str, Any]:  # a copy is not hooked: it reads the seconds counted so far
        return {**self.__dict__, "_on": False, "_began": None}
