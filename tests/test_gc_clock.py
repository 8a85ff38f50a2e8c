"""Python's collector is left out of the tuner's step times (Note: [the collector's time] in engine/gc_clock.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from test_plan_tuning import GB, _tuner

from poros_lightning.engine.gc_clock import CollectorClock
from poros_lightning.engine.tuner import PlanTuner


def test_the_clock_counts_collections_only_while_started() -> None:
    clock = CollectorClock()
    gc.collect()
    assert clock() == 0.0 and clock.collections == 0  # not started: not hooked
    clock.start()
    assert clock.start() is clock and gc.callbacks.count(clock._hook) == 1  # started once
    gc.collect()
    gc.collect(0)
    assert clock.collections == 2 and clock() > 0
    clock.stop()
    clock.stop()  # twice is harmless
    seconds = clock()
    gc.collect()
    assert clock._hook not in gc.callbacks and clock() == seconds


def _feed(tuner: PlanTuner, steps: list[tuple[float, float, int, int]]) -> None:
    """Steps ``(seconds on the clock, of which the collector's, peak allocated, peak reserved)``."""
    clock, collector, stats = [0.0], [0.0], [(0, 0, 0)]
    tuner.clock, tuner.collector = (lambda: clock[0]), (lambda: collector[0])
    tuner.stats, tuner.reset = (lambda: stats[0]), (lambda: None)
    tuner.step_boundary()
    for seconds, collected, allocated, reserved in steps:
        clock[0] += seconds
        collector[0] += collected
        stats[0] = (allocated, reserved, 0)
        tuner.step_boundary()


def test_a_step_slowed_by_a_full_collection_does_not_make_its_plan_slower() -> None:
    lines: list[str] = []
    tuner = _tuner(keep=4)
    tuner.log = lines.append
    # The 10-layer plan grew to 16 layers (room in its step). The 16-layer step took 1.55 s, 0.45 s of them in
    # the collector: 1.10 s, within the noise a growth is allowed (15%). Timed whole, it would run once more.
    _feed(tuner, [(5.0, 0.0, 2 * GB, 3 * GB), (1.0, 0.0, 2 * GB, 3 * GB), (1.55, 0.45, 8 * GB, 9 * GB)])
    assert [s.keep_activations for s in tuner.history] == [4, 10, 16]
    last = tuner.history[-1]
    assert last.seconds == pytest.approx(1.10) and last.collector_s == pytest.approx(0.45)
    assert tuner.keep == 16 and "slower" not in last.action
    assert "step 3 ran 1.100 s (and 0.450 s in Python's collector)" in lines[-1]
    assert PlanTuner.summary(tuner.history)[-1]["collector_ms"] == pytest.approx(450.0)


def test_the_tuner_hooks_its_own_clock_while_it_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # the default clock, on a CPU
    before = list(gc.callbacks)
    tuner = _tuner(keep=4, steps=3)
    tuner.stats, tuner.reset = (lambda: (GB, 2 * GB, 0)), (lambda: None)
    try:
        tuner.step_boundary()  # the first step opens: the tuner's clock is hooked
        hooked = [cb for cb in gc.callbacks if cb not in before]
        assert len(hooked) == 1
        gc.collect()
        tuner.step_boundary()
        assert tuner.history[0].collector_s > 0
    finally:
        tuner.finish()
    assert tuner.done and gc.callbacks == before  # unhooked when it stops measuring


def test_the_strategy_stops_a_tuner_that_did_not_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fit shorter than ``tune_steps`` (or one that raised) leaves its tuner measuring: the strategy stops it
    when training ends, so nothing stays hooked in ``gc.callbacks``."""
    from lightning.pytorch.accelerators import CPUAccelerator

    from poros_lightning import PorosStrategy

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    before = list(gc.callbacks)
    timer: list[bool] = []
    tuner = _tuner(keep=4, steps=8, timer=timer.append)
    tuner.stats, tuner.reset = (lambda: (GB, 2 * GB, 0)), (lambda: None)
    strategy = PorosStrategy(accelerator=CPUAccelerator())
    strategy.tuners.append(tuner)
    tuner.step_boundary()  # one step of eight opened, then training ends
    assert len(gc.callbacks) == len(before) + 1 and timer == [True]
    strategy.on_train_end()
    assert tuner.done and gc.callbacks == before and timer == [True, False] and strategy.tuners == []
    strategy.teardown()  # again at teardown: nothing left to stop


def test_a_bench_step_that_raises_stops_its_tuner() -> None:
    from poros_lightning.tools.bench.steps import step_loop

    class Fails(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("a step that ran out")

    class Tuner:
        closed = False

        def step_boundary(self) -> None: ...

        def close(self) -> None:
            self.closed = True

    tuner = Tuner()
    with pytest.raises(RuntimeError, match="ran out"):
        step_loop(Fails(), [torch.zeros(1, 4, dtype=torch.long)] * 2, warmup=1, vocab=8, device="cpu", tuner=tuner)
    assert tuner.closed


def test_a_copied_clock_is_not_hooked() -> None:
    import copy

    clock = CollectorClock().start()
    try:
        gc.collect()
        twin = copy.deepcopy(clock)
        assert twin() == clock() and not twin._on
        twin.stop()  # nothing to unhook
        assert clock._hook in gc.callbacks
    finally:
        clock.stop()


def test_a_bench_row_counts_the_collector_in_the_step_it_ran_in() -> None:
    from types import SimpleNamespace

    from poros_lightning.tools.bench.steps import step_loop

    class CollectsOnce(torch.nn.Module):
        """Its third forward (the second timed step) runs a full collection."""

        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 8)
            self.calls = 0

        def forward(self, input_ids: torch.Tensor, **kwargs: object) -> SimpleNamespace:
            self.calls += 1
            if self.calls == 3:
                for _ in range(3):  # long enough to stand out of the steps' own collections
                    gc.collect()
            return SimpleNamespace(logits=self.emb(input_ids))

    counts: dict[str, object] = {}
    times = step_loop(CollectsOnce(), [torch.zeros(1, 4, dtype=torch.long)] * 4, 1, 8, "cpu", counts=counts)
    steps = counts["gc_step_s"]
    assert len(steps) == len(times) == 3
    assert steps[1] > 10 * max(steps[0], steps[2], 1e-6)  # the step that collected, not the others
    assert sum(steps) == pytest.approx(sum(counts["gc_seconds"]), abs=1e-5)
