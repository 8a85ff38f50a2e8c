"""Fit the plan to the card during the first steps, from what each step really used and how long it took.

Invariant: the tuner changes only how many layers keep their activations and how many blocks stay resident,
between steps; every value gives the same bits (Note: [kept activations] in block.py, Note: [resident blocks] in
slots.py), so tuning changes the speed and memory of a run, never its result.

Note: [measured plans]
    The planner's activation figures are estimates, and a card's limit is on what the caching allocator
    *reserves*, fragmentation included. So after each early step the tuner reads the step's real peaks
    (allocated and reserved) and the allocator's retries (a retry frees the cache and calls ``cudaMalloc``
    again: a step that needed one ran at the edge of the budget, slowly):
    - over the budget, or any retry: drop as many kept layers as the excess needs, plus one (then resident
      blocks, once no layer keeps its activations);
    - once, from the second step's device timings (engine ``timings()``: seconds per block copy, per block of a
      forward through the layers without the waits on copies, and per layer recompute in the backward, each
      layer timed from behind its wait), spend the memory where it buys more time per byte
      (``memory.planner.resident_pays``): a kept layer skips its recompute; a resident block skips two copies,
      but saves only what of them the forward leaves exposed. The planner's starting point estimates a layer
      forward from its tokens (``memory.planner.layer_forward_s``); this is where the card's own numbers
      replace it. The recompute is timed on its own because the host can bound it where it does not bound the
      forward: at Qwen2.5-32B on the H100 a 252 MB block copied in 4.6 ms against 2.6 ms of a layer's kernels,
      which alone made resident blocks look the better buy; the tuner traded kept layers for resident blocks
      in eight of ten runs, none faster, and undid five that ran 1.07-1.60 times slower, 5.4-7.3 ms per layer
      given up (planner_sweep.jsonl, run 2026-12-07T15:53:12);
    - room for at least one more layer's activations (measured per layer once two plans have run, each peak
      less its resident blocks, which a trade changes at the same time): keep that many more; while the bytes
      per layer are still the planner's estimate, only half as many (an estimate that was low for a family
      made the next step run out of memory on the H200: Gemma-4-31B, docs/benchmarks/families.jsonl);
    - a plan more than 3% slower than the fastest one measured goes back to the fastest, and the tuner stops. A
      plan that only grew its kept layers gets :data:`GROWN_NOISE` (15%) instead: it does strictly less work
      than the plan before it, and one step's time varies by 10% on the same plan (Qwen2.5-7B, H100: one plan,
      0.294 s and 0.341 s in two rounds), so a few percent slower there is the machine's noise, not the plan's
      (a growth that crowds the allocator shows as retries). A plan is judged by the faster of its steps, and
      one that times slower in its first step runs once more before it is judged: on a host-bound step one step
      can run 18% slower than the same plan's next (Qwen2.5-7B, seq 2048, H100: 10 kept layers at 0.374 s in one
      round and 0.466 s in the next, where that one step sent the plan back; planner_sweep.jsonl, run
      2026-12-07T17:10:18). A plan slower in both its steps (each within the budget) is not sent back at once: the
      fastest plan runs once more, and the slower plan's two steps are compared with the fastest plan's best step
      and that rerun, by their means. Where the best step came just before the slower plan's, the four steps run
      A B B A, and a machine that slowed down or sped up steadily over them moves both means alike. The later plan
      stays unless its mean is more than the margin slower; a rerun over the budget, or retried, shrinks as any
      step that did. At Qwen2.5-72B, seq 512 (H100), a plan measured once at 1.594 s sent back a plan that ran 1.795 and
      1.659 s, then ran its own timed steps at 1.901 s on average (planner_sweep.jsonl, run 2026-12-07T19:01:54).
    A step's time is its time less what Python's garbage collector took in it: a full collection falls in some
    steps and not others, whatever the plan (Note: [the collector's time] in engine/gc_clock.py).
    It stops after ``steps`` measured steps (the last one only verifies: nothing grows that no step measured)
    or once nothing changes; the plan then stays. Everything else a plan chooses (slots, host-side options) is
    sized from exact byte counts at setup.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from poros_lightning.engine.gc_clock import CollectorClock

__all__ = ["GROWN_NOISE", "PlanTuner", "TunerStep"]

GROWN_NOISE = 1.15
"""How much slower than the fastest measured plan a plan that only grew its kept layers may time before the tuner
goes back: it does strictly less work, and one step's time varies by 10% on the same plan (Note: [measured
plans]); a plan that slow is more than noise (an allocator at its edge, a host that has changed)."""


@dataclass
class TunerStep:
    """One measured step: the plan it ran, its time and peaks (bytes), and what the tuner did next."""

    keep_activations: int
    seconds: float
    peak_allocated: int
    peak_reserved: int
    retries: int
    action: str = ""
    resident_blocks: int = 0
    copy_s: float = 0.0
    block_forward_s: float = 0.0
    compute_s: float = 0.0
    recompute_s: float = 0.0
    grew: bool = False
    collector_s: float = 0.0


@dataclass
class PlanTuner:
    """Moves ``keep_activations`` of the engines of one run until the measured step fits its budget and is fastest.

    Args:
        set_keep: applies a number of kept layers to every engine of the run (between steps).
        keep: the planned number of kept layers.
        num_layers: decoder layers of the model (the most that can keep their activations).
        budget: the run's device budget in bytes (reserved memory).
        layer_bytes: the planner's estimate of one layer's kept activations.
        device: the CUDA device whose memory is measured.
        steps: early steps the tuner measures before the plan stays.
        log: receives one line per decision.
        stats: returns ``(peak allocated, peak reserved, allocator retries)`` since the last reset, and
            ``reset`` starts a new window (both default to the CUDA caching allocator's; tests pass fakes).
        clock: seconds, after the device finished the step's work (default: synchronize, then ``perf_counter``).
        set_resident: applies a number of resident blocks (between steps); ``None``: the tuner leaves them.
        resident: the planned number of resident blocks.
        num_blocks: blocks of the model.
        block_bytes: device bytes of one block's slot.
        timings: the step's device timings, ``{"copy_s": ..., "block_forward_s": ...}`` (engine ``timings()``).
        timer: starts (``True``, which also clears what was timed) or stops (``False``) the device timing that
            ``timings`` reads (engine ``time_steps``); the tuner times its own steps only.
        pays: ``pays(copy_s, forward_s, block_bytes, layer_bytes, layers_per_block, recompute_s)``: whether
            memory saves more time per byte as resident blocks than as kept activations
            (``memory.planner.resident_pays``, the planner's own rule); ``None``: the tuner does not trade.
        collector: cumulative seconds of Python's garbage collector; each step is timed less what it grew by in the
            step (Note: [the collector's time] in engine/gc_clock.py). ``None``: with the default ``clock``, the
            tuner's own :class:`CollectorClock`, hooked while it measures; with a ``clock`` passed in, nothing.
    """

    set_keep: Callable[[int], None]
    keep: int
    num_layers: int
    budget: int
    layer_bytes: int
    device: torch.device
    steps: int = 8
    log: Callable[[str], None] = print
    stats: Callable[[], tuple[int, int, int]] | None = None
    reset: Callable[[], None] | None = None
    clock: Callable[[], float] | None = None
    set_resident: Callable[[int], None] | None = None
    resident: int = 0
    num_blocks: int = 0
    block_bytes: int = 0
    timings: Callable[[], dict[str, float]] | None = None
    timer: Callable[[bool], None] | None = None
    pays: Callable[[float, float, int, int, float, float], bool] | None = None
    collector: Callable[[], float] | None = None
    history: list[TunerStep] = field(default_factory=list)
    done: bool = False
    _traded: bool = False
    _timing: bool = False
    _started: float | None = None
    _retries: int = 0
    _ceiling: int | None = None
    _rematch: tuple[list[TunerStep], TunerStep, float] | None = None  # the slower plan's steps, the fastest, margin
    _own_collector: CollectorClock | None = None  # the one this tuner hooked, unhooked when it stops
    _collected: float = 0.0  # the collector's seconds when the running step began

    def _stats(self) -> tuple[int, int, int]:
        if self.stats is not None:
            return self.stats()
        stats = torch.cuda.memory_stats(self.device)
        return (
            int(stats.get("allocated_bytes.all.peak", 0)),
            int(stats.get("reserved_bytes.all.peak", 0)),
            int(stats.get("num_alloc_retries", 0)),
        )

    def _now(self) -> float:
        if self.clock is not None:
            return self.clock()
        torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _reset(self) -> None:
        if self.reset is not None:
            self.reset()
        else:
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_boundary(self) -> None:
        """Call before every training step: closes the previous step's measurement, adjusts, opens the next."""
        if self.done:
            self._time(False)
            return
        if self._started is not None:
            seconds = self._now() - self._started
            collected = self._collector_s() - self._collected  # Note: [the collector's time]
            allocated, reserved, retries = self._stats()
            step = TunerStep(
                self.keep, seconds - collected, allocated, reserved, retries - self._retries, "", self.resident
            )
            step.collector_s = collected
            if self.timings is not None and self._timing:
                timed = self.timings()
                step.copy_s, step.block_forward_s = timed.get("copy_s", 0.0), timed.get("block_forward_s", 0.0)
                step.compute_s = timed.get("compute_s", 0.0)
                step.recompute_s = timed.get("recompute_s", 0.0)
            self.history.append(step)
            self._decide()
            if self.done:
                self._time(False)
                return
        self._reset()
        self._retries = self._stats()[2]
        self._time(True)
        self._started = self._now()
        self._collected = self._collector_s()

    def finish(self) -> None:
        """Close the running step's measurement as the last one, and stop: a plan that ran over the budget or
        slower than the fastest measured one still goes back, but nothing grows that no step measured."""
        if not self.done and self._started is not None:
            self.steps = min(self.steps, len(self.history) + 1)
            self.step_boundary()
        self.done = True
        self._time(False)

    def close(self) -> None:
        """Stop measuring without judging the running step (training ended, or raised): the plan stays as it is, and
        the device timing and the collector's clock are unhooked."""
        self.done = True
        self._time(False)

    def _time(self, enable: bool) -> None:
        if self.timer is not None and (enable or self._timing):
            self.timer(enable)
        self._timing = enable and self.timer is not None
        if not enable and self._own_collector is not None:  # stopped measuring: unhook the collector's clock
            self._own_collector.stop()
            self._own_collector = None

    def _collector_s(self) -> float:
        if self.collector is None and self.clock is None and not self.done:
            self._own_collector = CollectorClock().start()
            self.collector = self._own_collector
        return self.collector() if self.collector is not None else 0.0

    def measured_layer_bytes(self) -> int:
        """Bytes per kept layer from two measured plans (the estimate until two plans have run).

        Each peak is taken less its resident blocks' bytes: a trade changes both at once, and the 28 blocks that
        became 28 layers' activations at Qwen2.5-32B (24 GB, H100) read, uncorrected, as a quarter of a layer's
        real bytes, grew 10 more layers into 1.3 GB of room, and the next step ran out of memory."""
        by_keep: dict[int, int] = {}
        for s in self.history[1:]:  # the first step also allocates what every later step reuses
            peak = s.peak_allocated - s.resident_blocks * self.block_bytes
            by_keep[s.keep_activations] = max(by_keep.get(s.keep_activations, peak), peak)
        if len(by_keep) < 2:
            return self.layer_bytes
        (k0, p0), (k1, p1) = sorted(by_keep.items())[0], sorted(by_keep.items())[-1]
        return max(int((p1 - p0) / (k1 - k0)), self.layer_bytes // 2, 1) if k1 != k0 else self.layer_bytes

    def measured(self) -> bool:
        """Whether two plans with different kept layers have run (after the first step), so that the bytes per
        kept layer are measured rather than estimated."""
        return len({s.keep_activations for s in self.history[1:]}) >= 2

    def _runs_of_the_last_plan(self) -> list[TunerStep]:
        """The last steps that ran the last step's plan (the same kept layers and resident blocks), latest first."""
        plan = (self.history[-1].keep_activations, self.history[-1].resident_blocks)
        runs: list[TunerStep] = []
        for step in reversed(self.history):
            if (step.keep_activations, step.resident_blocks) != plan:
                break
            runs.append(step)
        return runs

    def _apply(self, keep: int, action: str, resident: int | None = None) -> None:
        keep = max(0, min(keep, self.num_layers))
        self.history[-1].action = action
        last = self.history[-1]
        collected = f" (and {last.collector_s:.3f} s in Python's collector)" if last.collector_s >= 5e-4 else ""
        self.log(
            f"poros plan: step {len(self.history)} ran {last.seconds:.3f} s{collected}, peak "
            f"{last.peak_reserved / 1e9:.2f} GB reserved of {self.budget / 1e9:.2f} GB: {action}"
        )
        if keep != self.keep:
            self.keep = keep
            self.set_keep(keep)
        if resident is not None and resident != self.resident and self.set_resident is not None:
            self.resident = max(resident, 0)
            self.set_resident(self.resident)

    def _trade(self, last: TunerStep, per_layer: int) -> bool:
        """Moves memory between resident blocks and kept activations by the step's timings (Note: [measured plans])."""
        if self._traded or self.set_resident is None or self.pays is None or not self.block_bytes:
            return False
        if len(self.history) < 2:  # the first step's timings include its warm-up
            return False
        if not last.copy_s or not last.block_forward_s:
            return False
        self._traded = True
        forward = last.compute_s or last.block_forward_s  # without the waits on copies, where they were timed
        timed = f"a block copies in {last.copy_s * 1e3:.1f} ms, a block's forward takes {forward * 1e3:.1f} ms"
        if last.recompute_s:
            timed += f", a layer's recompute {last.recompute_s * 1e3:.1f} ms"
        layers_per_block = self.num_layers / self.num_blocks if self.num_blocks else 1.0
        resident_first = self.pays(
            last.copy_s, forward, self.block_bytes, per_layer, layers_per_block, last.recompute_s
        )
        if not resident_first and self.resident and self.keep < self.num_layers:
            freed = self.resident * self.block_bytes
            limit = self.num_layers if self._ceiling is None else self._ceiling  # never past what did not fit
            more = max(min(freed // per_layer, limit - self.keep), 0)
            if not more:  # every resident block together holds less than one layer's activations
                return False
            if more > 1 and not self.measured():  # as for room: half as many on an estimate
                more //= 2
            resident = (freed - more * per_layer) // self.block_bytes
            self._apply(self.keep + more, f"{timed}: per byte, kept layers save more, {self.resident - resident} "
                        f"resident blocks become {more} layers' kept activations", resident)  # fmt: skip
            return True
        ring_blocks = max(self.num_blocks - 2, 0)  # the ring's two slots stream the rest
        if resident_first and self.keep and self.resident < ring_blocks:
            freed = self.keep * per_layer
            more = min(freed // self.block_bytes, ring_blocks - self.resident)
            if more:
                fewer = min(self.keep, -(-more * self.block_bytes // per_layer))
                self._apply(self.keep - fewer, f"{timed}: copies bound the step, per byte resident blocks save "
                            f"more, {fewer} layers' kept activations become {more} resident blocks",
                            self.resident + more)  # fmt: skip
                return True
        return False

    def _decide(self) -> None:
        last = self.history[-1]
        if self._rematch is not None:  # the fastest plan ran again
            rematch, self._rematch = self._rematch, None
            if not last.retries and last.peak_reserved <= self.budget:
                self._settle(last, *rematch)
                return  # else: shrink it, as any step over the budget
        per_layer = self.measured_layer_bytes()
        if last.peak_reserved > self.budget or last.retries:
            excess = max(last.peak_reserved - self.budget, 0)
            drop = math.ceil(excess / per_layer) + 1
            self._ceiling = max(self.keep - drop, 0)  # never grow back past what did not fit
            resident = self.resident
            if drop > self.keep and self.resident and self.block_bytes:  # no kept layer left to drop
                resident = max(self.resident - math.ceil((drop - self.keep) * per_layer / self.block_bytes), 0)
            why = (
                "over the budget"
                if last.peak_reserved > self.budget
                else f"{last.retries} allocations retried at the budget (the allocator emptied its cache to fit)"
            )
            self._apply(
                self.keep - drop, f"{why}: {self._ceiling} layers keep activations, {resident} resident blocks", resident
            )  # fmt: skip
            if (self.keep == 0 and self.resident == 0) or len(self.history) >= self.steps:
                self.done = True
            return
        timed = [s for s in self.history[1:] if not s.retries and s.peak_reserved <= self.budget]
        runs = self._runs_of_the_last_plan()
        before = len(self.history) - len(runs) - 1
        grown = before >= 0 and self.history[before].grew  # more kept layers, nothing else: less work
        if timed and last is not self.history[0]:
            fastest = min(timed, key=lambda s: s.seconds)
            margin = GROWN_NOISE if grown else 1.03
            judged = min(s.seconds for s in runs if s is not self.history[0])
            if judged > margin * fastest.seconds:
                if len(runs) == 1 and len(self.history) < self.steps:  # Note: [measured plans]: once more
                    self._apply(self.keep, f"slower than {fastest.seconds:.3f} s: this plan runs once more")
                    return
                clean = all(not s.retries and s.peak_reserved <= self.budget for s in runs)
                other = (fastest.keep_activations, fastest.resident_blocks) != (
                    last.keep_activations,
                    last.resident_blocks,
                )
                if len(runs) == 2 and clean and other and len(self.history) < self.steps:  # Note: [measured plans]
                    self._rematch = (runs, fastest, margin)
                    self._apply(
                        fastest.keep_activations, f"slower than {fastest.seconds:.3f} s twice: that plan runs again, "
                        "to tell a slower plan from a slower machine", fastest.resident_blocks,
                    )  # fmt: skip
                    return
                self._apply(
                    fastest.keep_activations, f"slower than {fastest.seconds:.3f} s: back to that plan",
                    fastest.resident_blocks,
                )  # fmt: skip
                self.done = True
                return
        if len(self.history) >= self.steps:  # the last measured step: the plan stays, never grown unmeasured
            self._apply(self.keep, "the plan stays")
            self.done = True
            return
        if self._trade(last, per_layer):
            return
        room = int(0.9 * (self.budget - last.peak_reserved))  # fragmentation grows with what is added
        limit = self.num_layers if self._ceiling is None else self._ceiling
        more = max(min(room // per_layer, limit - self.keep), 0) if per_layer else 0
        if more > 1 and not self.measured():  # Note: [measured plans]: half the room on an estimate
            more //= 2
        if more > 0:
            last.grew = True
            self._apply(self.keep + more, f"room for {more} more layers' activations")
        elif len(self.history) > 1:
            self._apply(self.keep, "the plan stays")
            self.done = True

    def _settle(self, again: TunerStep, runs: list[TunerStep], fastest: TunerStep, margin: float) -> None:
        """After the fastest plan ran ``again`` (within the budget): the mean of its best step and ``again`` against
        the slower plan's two ``runs`` (Note: [measured plans]); the slower plan comes back unless its mean is more
        than ``margin`` times the other's."""
        first = sum(s.seconds for s in (fastest, again)) / 2
        later = sum(s.seconds for s in runs) / len(runs)
        means = f"{later:.3f} s against {first:.3f} s, the mean of each plan's two steps"
        if later <= margin * first:
            plan = runs[0]
            self._apply(plan.keep_activations, f"{means}: the later plan stays", plan.resident_blocks)
        else:
            self._apply(self.keep, f"{means}: this plan stays")
        self.done = True

    @staticmethod
    def summary(history: Sequence[TunerStep]) -> list[dict[str, float | int | str]]:
        """The measured steps as plain dicts (for logs, bench rows and checkpoints)."""
        return [
            {
                "keep_activations": s.keep_activations,
                "resident_blocks": s.resident_blocks,
                "seconds": round(s.seconds, 4),
                "copy_ms": round(s.copy_s * 1e3, 3),
                "block_forward_ms": round(s.block_forward_s * 1e3, 3),
                "compute_ms": round(s.compute_s * 1e3, 3),
                "recompute_ms": round(s.recompute_s * 1e3, 3),
                "peak_allocated_gb": round(s.peak_allocated / 1e9, 3),
                "peak_reserved_gb": round(s.peak_reserved / 1e9, 3),
                "retries": s.retries,
                "collector_ms": round(s.collector_s * 1e3, 3),
                "action": s.action,
            }
            for s in history
        ]
