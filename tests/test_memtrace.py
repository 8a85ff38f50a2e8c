"""What was allocated at a step's peak (``bench run --memtrace``): the analysis of the allocator's trace, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench import _one_step_config

from poros_lightning.tools.bench.cli import main
from poros_lightning.tools.bench.memtrace import MARKER, NO_FRAME, label, peak_breakdown, reserved_by_stream

NORM = [
    {"filename": "/x/site-packages/torch/_tensor.py", "line": 5, "name": "to"},
    {"filename": "/x/site-packages/transformers/models/qwen2/modeling_qwen2.py", "line": 61, "name": "forward"},
    {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1775, "name": "_call_impl"},
    {"filename": "/x/site-packages/transformers/models/qwen2/modeling_qwen2.py", "line": 420, "name": "forward"},
]
HEAD = [
    {"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 134, "name": "forward"},
    {"filename": "/w/poros_lightning/training/chunked_loss.py", "line": 120, "name": "logits"},
]


def test_labels_name_the_code_outside_torch_that_allocated() -> None:
    assert label(NORM) == "_tensor.py:5 to < modeling_qwen2.py:61 forward"
    assert label(NORM[1:]) == "modeling_qwen2.py:61 forward"  # the innermost frame is already outside torch
    assert label(HEAD) == "linear.py:134 forward < chunked_loss.py:120 logits"
    assert label([{"filename": "/x/torch/autograd/graph.py", "line": 1, "name": "f"}]) == "graph.py:1 f"
    assert label([{"filename": "??", "line": 0, "name": "at::empty"}]) == NO_FRAME
    assert label([]) == NO_FRAME


def _alloc(addr: int, size: int, frames: list) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def _free(addr: int, size: int) -> list[dict]:
    return [
        {"action": "free_requested", "addr": addr, "size": size},
        {"action": "free_completed", "addr": addr, "size": size},
    ]


def test_the_peak_and_what_was_alive_there_by_where_it_was_allocated() -> None:
    trace = [
        _alloc(1, 100, NORM),
        _alloc(2, 300, HEAD),
        *_free(9, 50),  # allocated before the trace began
        _alloc(3, 200, HEAD),  # the peak: 1000 - 50 + 100 + 300 + 200 = 1550
        *_free(2, 300),
        *_free(3, 200),
        _alloc(4, 400, []),  # 1000 - 50 + 100 + 400 = 1450: below the peak
    ]
    out = peak_breakdown(trace, baseline=1000)
    assert out["peak_gb"] == round(1550 / 1e9, 4) and out["before_gb"] == round(950 / 1e9, 4)
    assert [(g["where"], g["count"]) for g in out["top"]] == [
        ("before the step", 0),
        ("linear.py:134 forward < chunked_loss.py:120 logits", 2),
        ("_tensor.py:5 to < modeling_qwen2.py:61 forward", 1),
    ]
    assert out["top"][1]["gb"] == round(500 / 1e9, 4) and out["events"] == len(trace)
    # A block counts until its free is requested (a side stream may hold it longer, but it is not allocated).
    late = [_alloc(1, 100, HEAD), {"action": "free_requested", "addr": 1, "size": 100}, _alloc(2, 80, HEAD),
            {"action": "free_completed", "addr": 1, "size": 100}]  # fmt: skip
    assert peak_breakdown(late, baseline=0)["peak_gb"] == round(100 / 1e9, 4)

    # Phase marks (one-element allocations from MARKER) name the phase of the peak and weigh nothing.
    def mark(addr: int) -> list[dict]:
        return [_alloc(addr, 512, [{"filename": "/w/memtrace.py", "line": 1, "name": MARKER}]), *_free(addr, 512)]

    phased = [*mark(90), _alloc(1, 100, HEAD), *mark(91), *_free(1, 100), *mark(92), _alloc(2, 300, NORM), *mark(93)]
    out = peak_breakdown(phased, baseline=0)
    assert out["phase"] == "update" and out["peak_gb"] == round(300 / 1e9, 4)
    assert peak_breakdown(phased[:8], baseline=0)["phase"] == "forward"  # the peak before the second mark
    assert peak_breakdown(trace, baseline=1000)["phase"] is None  # no marks: no phase
    # Nothing above the baseline: the peak is what was there before.
    quiet = peak_breakdown([*_free(9, 50)], baseline=1000)
    assert quiet["peak_gb"] == round(1000 / 1e9, 4) and quiet["top"] == [
        {"where": "before the step", "gb": round(1000 / 1e9, 4), "count": 0}
    ]


def test_memtrace_is_cuda_only_and_the_report_prints_traced_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _one_step_config(tmp_path, runs=[{"method": "poros"}])
    assert main(["run", str(path), "--memtrace"]) == 0
    (row,) = map(json.loads, (tmp_path / "bench.jsonl").read_text().splitlines())
    assert row["s_per_step"] > 0 and not any(k.startswith("memtrace_") for k in row)  # on CPU: none made up
    traced = {
        "scale": "7B",
        "seq_len": 512,
        "method": "poros_min",
        "s_per_step": 1.0,
        "final_planned_peak_gb": 1.869,
        "memtrace_peak_gb": 1.97,
        "memtrace_phase": "update",
        "memtrace_max_allocated_gb": 2.01,
        "memtrace_top": [{"where": "before the step", "gb": 1.5, "count": 0}, {"where": "a|b", "gb": 0.12, "count": 3}],
        "memtrace_reserved_peak_gb": 3.2,
        "memtrace_by_stream": [
            {"stream": "side 1", "reserved_gb": 1.1, "allocated_gb": 0.0, "free_gb": 1.1},
            {"stream": "compute", "reserved_gb": 2.1, "allocated_gb": 1.97, "free_gb": 0.13},
        ],
    }
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n" + json.dumps(traced) + "\n")
    assert main(["report", str(rows), "--memtrace", "-o", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "| 7B | 512 | poros_min | 1.970 | 2.010 | update | 1.869 | `before the step` | 1.500 | 0 |" in out
    assert "|  |  |  |  |  |  |  | `a/b` | 0.120 | 3 |" in out
    assert "| 7B | 512 | poros_min | 3.200 | side 1 | 1.100 | 0.000 | 1.100 |" in out
    assert "|  |  |  |  | compute | 2.100 | 1.970 | 0.130 |" in out


def test_record_step_keeps_the_allocators_peak_across_the_steps_resets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's step resets the peak statistics at each phase; the step's allocator peak is their maximum, and the
    history and the reset function are given back even when the step raises."""
    import torch

    from poros_lightning.tools.bench import memtrace

    state = {"max": 0, "history": None, "resets": 0}
    trace = [_alloc(1, 700, HEAD), *_free(1, 700)]
    original = torch.cuda.reset_peak_memory_stats

    def fake_reset(*_args: object, **_kwargs: object) -> None:
        state["resets"] += 1
        state["max"] = 0

    def history(enabled: object, *_args: object, **_kwargs: object) -> None:
        state["history"] = enabled

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake_reset)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: state["max"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", history)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"device_traces": [trace], "segments": []})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: type("S", (), {"cuda_stream": 0})())

    def step(mark: object) -> None:
        state["max"] = 2048  # the forward's peak, then the step's own reset at the phase boundary
        torch.cuda.reset_peak_memory_stats()
        state["max"] = 1700

    out = memtrace.record_step(step)
    assert out["max_allocated_gb"] == round(2048 / 1e9, 4) and out["peak_gb"] == round(1700 / 1e9, 4)
    assert torch.cuda.reset_peak_memory_stats is fake_reset and state["history"] is None

    def failing(mark: object) -> None:
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        memtrace.record_step(failing)
    assert torch.cuda.reset_peak_memory_stats is fake_reset and state["history"] is None
    assert original is not fake_reset


def test_reserved_by_stream_finds_a_side_pools_free_memory_at_the_reserved_peak() -> None:
    """A side stream's pool (stream 7) allocates a copy, frees it, and cannot reuse it for the next copy: it grows.
    Its 600 units are free when the compute stream (0) grows to its own peak: the step reserves them for nothing."""
    U = 10**8  # bytes per unit

    def ev(action: str, size: int, stream: int) -> dict:
        return {"action": action, "addr": 0, "size": size * U, "stream": stream}

    trace = [
        ev("alloc", 200, 0),
        ev("alloc", 300, 7),  # the first copy
        ev("free_requested", 300, 7),
        ev("segment_map", 300, 7),  # the second copy finds the first's block still in use on the GPU
        ev("alloc", 300, 7),
        ev("free_requested", 300, 7),
        ev("segment_map", 400, 0),
        ev("alloc", 500, 0),  # the compute stream's peak: 700 allocated of 1000 reserved
        ev("free_requested", 600, 0),
        ev("segment_unmap", 400, 0),
    ]
    end = [
        {"stream": 0, "total_size": 600 * U, "allocated_size": 100 * U},
        {"stream": 7, "total_size": 600 * U, "allocated_size": 0},
    ]
    out = reserved_by_stream(trace, end, compute=0)
    assert out["reserved_peak_gb"] == 160.0  # 1600 x 0.1 GB
    assert out["by_stream"] == [
        {"stream": "side 1", "reserved_gb": 60.0, "allocated_gb": 0.0, "free_gb": 60.0},
        {"stream": "compute", "reserved_gb": 100.0, "allocated_gb": 70.0, "free_gb": 30.0},
    ]
    # Without events the breakdown is the segments as they are.
    assert reserved_by_stream([], end, compute=0)["reserved_peak_gb"] == 120.0
