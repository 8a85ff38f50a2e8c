"""The bench harness on CPU: every method and option runs end to end and records what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import tiny_config

from poros_lightning.errors import PorosConfigError
from poros_lightning.tools.bench.cli import load_bench_config, main, model_entries

SWEEP_FIELDS = {
    "vram_budget",
    "planned_peak_gb",
    "peak_vram_gb",
    "peak_reserved_gb",
    "oom",
    "refused",
    "s_per_step",
    "scale",
    "seq_len",
}


def _run(tmp_path: Path, cfg: dict) -> list[dict]:
    """``bench run`` of ``cfg`` (its ``out`` under ``tmp_path``); the rows it wrote."""
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(path)]) == 0
    return [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]


def test_bench_run_writes_one_row_per_method(tmp_path: Path) -> None:
    cfg = {
        "model": "tiny-qwen2",
        "model_config": tiny_config(),
        "scale": "tiny",
        "seq_lens": [16],
        "lora_r": 4,
        "steps": 2,
        "warmup": 1,
        "runs": [
            {"method": "resident"},
            {"method": "resident_gc"},
            {"method": "poros"},
            {
                "method": "poros",
                "name": "poros_min",
                "embeddings_on_host": True,
                "head_on_host": True,
                "optimizer_on_host": True,
            },
            {"method": "poros", "name": "poros_planned", "vram_budget": "4GB"},
            {"method": "poros", "name": "poros_keep", "keep_activations": 4},
            {"method": "poros", "name": "poros_min_plan", "vram_budget": "min", "resident_blocks": 1},
        ],
        "out": str(tmp_path / "bench.jsonl"),
    }
    rows = {r["method"]: r for r in _run(tmp_path, cfg)}
    assert list(rows) == [
        "resident",
        "resident_gc",
        "poros",
        "poros_min",
        "poros_planned",
        "poros_keep",
        "poros_min_plan",
    ]
    # vram_budget: min plans for the smallest budget the planner accepts: every host-side option on
    smallest = rows["poros_min_plan"]
    assert 0 < smallest["planned_peak_gb"] <= smallest["vram_budget"] < 4.0
    assert smallest["optimizer_on_host"] and any("host memory" in line for line in smallest["plan"])
    # an option the run sets wins over the plan's choice, as in PorosStrategy, and the plan's lines say so
    assert (
        smallest["resident_blocks"] == 1
        and smallest["plan"][-1] == "resident_blocks=1 set explicitly (the plan chose 0)"
    )
    assert all(r["s_per_step"] > 0 and not r["oom"] for r in rows.values())
    assert all(0 < r["host_issue_s_per_step"] <= r["s_per_step"] for r in rows.values())
    for r in rows.values():  # each timed step's time, whose mean is s_per_step; no GPU, no clocks
        assert len(r["step_s"]) == r["steps"] and r["step_s"][0] > 0 and r["gpu_clocks"] is None
        assert abs(sum(r["step_s"]) / len(r["step_s"]) - r["s_per_step"]) < 1e-3
    for r in rows.values():  # the host's clock splits the issuing into the step's three phases
        phases = [r[f"host_{name}_s_per_step"] for name in ("forward", "backward", "update")]
        assert all(p > 0 for p in phases) and sum(phases) <= r["host_issue_s_per_step"] + 1e-9
    assert rows["poros_min"]["head_loads_per_step"] == 2 and rows["poros_min"]["optimizer_on_host"]
    assert rows["poros"]["loads_per_step"] > 0 and "head_loads_per_step" not in rows["poros"]
    assert rows["poros_planned"]["plan"][-1].startswith("budget 4.00 GB")
    assert rows["poros_planned"]["vram_budget"] == 4.0 and 0 < rows["poros_planned"]["planned_peak_gb"] <= 4.0
    for r in rows.values():  # the fields a budget sweep plots, on every row
        assert SWEEP_FIELDS <= set(r), SWEEP_FIELDS - set(r)
        assert r["scale"] == "tiny" and r["seq_len"] == 16 and r["refused"] is False
        assert r["peak_vram_gb"] is None and r["peak_reserved_gb"] is None  # CPU: no device peaks made up
    assert rows["poros"]["vram_budget"] is None and rows["poros"]["planned_peak_gb"] is None
    assert rows["poros_planned"]["resident_blocks"] == 2  # a tiny model: all but the two ring blocks stay
    assert rows["poros_planned"]["keep_activations"] == 4  # and every layer keeps its activations
    assert rows["poros_keep"]["keep_activations"] == 4
    for r in rows.values():  # the GPU split of the step (CUDA events) is absent on CPU, not made up
        assert "forward_s_per_step" not in r


def test_bench_config_rejects_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"runs": [{"method": "poros"}], "seqlen": 5}))
    with pytest.raises(PorosConfigError, match="seqlen"):
        load_bench_config(path)


def _one_step_config(tmp_path: Path, **edits: object) -> Path:
    """A bench YAML on the tiny model, one timed step per run, rows to ``tmp_path / "bench.jsonl"``."""
    cfg = {
        "model_config": tiny_config(),
        "seq_lens": [8],
        "lora_r": 4,
        "steps": 1,
        "warmup": 1,
        "out": str(tmp_path / "bench.jsonl"),
        **edits,
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("from_cli", [False, True])
def test_rounds_interleave_the_methods(tmp_path: Path, from_cli: bool) -> None:
    runs = [{"method": "resident_gc"}, {"method": "poros"}]
    path = _one_step_config(tmp_path, runs=runs, **({} if from_cli else {"rounds": 2}))
    assert main(["run", str(path), *(["--rounds", "2"] if from_cli else [])]) == 0
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [(r["method"], r["round"]) for r in rows] == [
        ("resident_gc", 0),
        ("poros", 0),
        ("resident_gc", 1),
        ("poros", 1),
    ]
    assert len({r["run_id"] for r in rows}) == 1


def test_report_ratio_table_averages_rounds_within_a_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = [
        {"run_id": "a", "model": "m", "seq_len": 8, "method": "base", "s_per_step": 1.0, "peak_vram_gb": 2.0},
        {"run_id": "a", "model": "m", "seq_len": 8, "method": "fast", "s_per_step": 0.5, "peak_vram_gb": 1.0},
        {"run_id": "a", "model": "m", "seq_len": 8, "method": "base", "s_per_step": 3.0, "peak_vram_gb": 2.0},
        {"run_id": "a", "model": "m", "seq_len": 8, "method": "fast", "s_per_step": 1.5, "peak_vram_gb": 1.5},
        {"run_id": "b", "model": "m", "seq_len": 8, "method": "fast", "s_per_step": 9.0},  # no baseline in run b
        {"run_id": "a", "model": "n", "seq_len": 8, "method": "fast", "s_per_step": 7.0},  # another model
        {"model": "m", "seq_len": 8, "method": "base", "s_per_step": 5.0},  # an older row without a run
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert main(["report", str(path), "-o", str(tmp_path / "r.html"), "--ratio-to", "base"]) == 0
    out = capsys.readouterr().out
    assert "| m | 8 | base | 2 | 2.000 | 1.000..3.000 | 4.000 | 2.000 | 1.000 |" in out
    assert "| m | 8 | fast | 2 | 1.000 | 0.500..1.500 | 8.000 | 1.500 | 0.500 |" in out
    ratios = out.split("x base")[1]
    assert "9.000" not in ratios and "7.000" not in ratios and "5.000" not in ratios


def test_rows_are_written_as_each_run_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that fails after the first one leaves the first one's row in the JSONL."""
    from poros_lightning.tools.bench import harness

    path = _one_step_config(tmp_path, runs=[{"method": "resident"}, {"method": "poros"}])
    calls = []
    step_loop = harness.step_loop

    def fails_second(*args: object, **kwargs: object) -> list[float]:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill mid-run
        return step_loop(*args, **kwargs)

    monkeypatch.setattr(harness, "step_loop", fails_second)
    with pytest.raises(KeyboardInterrupt):
        main(["run", str(path)])
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["resident"]


def _event(cat: str, name: str, ts: float, dur: float, stream: int, nbytes: int = 0) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "bytes": nbytes}}


def test_timeline_splits_idle_time_into_link_and_host_waits() -> None:
    from poros_lightning.tools.bench.timeline import MARKER, summarize_trace

    h2d, d2h = "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"
    trace = {
        "traceEvents": [
            *(_event("kernel", MARKER, ts, 1, 7) for ts in (0, 100, 300, 350)),
            # forward [1, 100): kernels 1..21 and 61..81; a side copy 11..71 covers the idle 21..61
            _event("kernel", "gemm", 1, 20, 7),
            _event("kernel", "gemm", 61, 20, 7),
            _event("gpu_memcpy", h2d, 11, 60, 13, nbytes=3_000_000_000),
            # backward [101, 300): 150 us busy (one compute-stream copy of 50), 49 us idle, no side copy
            _event("kernel", "gemm", 101, 100, 7),
            _event("gpu_memcpy", h2d, 201, 50, 7, nbytes=1_000_000_000),
            # update [301, 350): one kernel; a copy out on a side stream
            _event("kernel", "adamw", 301, 10, 7),
            _event("gpu_memcpy", d2h, 311, 30, 15, nbytes=2_000_000_000),
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 400},  # not GPU time
        ]
    }
    got = summarize_trace(trace)
    assert got["forward_s"] == pytest.approx(99e-6)
    assert got["forward_busy_s"] == pytest.approx(40e-6)
    assert got["forward_idle_copying_s"] == pytest.approx(40e-6)  # 21..61
    assert got["forward_idle_host_s"] == pytest.approx(19e-6)  # 81..100
    assert got["forward_side_h2d_gb"] == pytest.approx(3.0) and got["forward_kernels"] == 2
    assert got["backward_busy_s"] == pytest.approx(150e-6) and got["backward_compute_copy_s"] == pytest.approx(50e-6)
    assert got["backward_idle_host_s"] == pytest.approx(49e-6) and got["backward_idle_copying_s"] == 0
    assert got["update_d2h_gb"] == pytest.approx(2.0) and got["update_side_h2d_gb"] == 0
    with pytest.raises(ValueError, match="4 phase markers"):
        summarize_trace({"traceEvents": trace["traceEvents"][1:]})
    from poros_lightning.tools.bench.timeline import kernel_summary

    kernels = kernel_summary(trace, top=2)  # every stream, markers and host events left out
    assert kernels["kernel_groups"] == {"matmul": pytest.approx(140e-6), "memcpy": pytest.approx(140e-6),
                                        "other": pytest.approx(10e-6)}  # fmt: skip
    assert kernels["top_kernels"][0] == {"name": "gemm", "s": pytest.approx(140e-6), "count": 3}
    assert len(kernels["top_kernels"]) == 2
    named = kernel_summary({"traceEvents": [_event("kernel", "void kDequantizeBlockwise<bf16>", 0, 5, 7),
                                            _event("kernel", "_rms_layernorm_forward", 5, 5, 7)]})  # fmt: skip
    assert set(named["kernel_groups"]) == {"nf4 dequantize", "norm, softmax, loss"}


def test_host_figures_name_the_calls_and_functions_that_spent_the_time() -> None:
    import cProfile
    import pstats

    from poros_lightning.tools.bench.report import host_table
    from poros_lightning.tools.bench.timeline import host_summary, runtime_summary

    sync, launch = "cudaStreamSynchronize", "cudaLaunchKernel"
    trace = {"traceEvents": [*({"ph": "X", "cat": "cuda_runtime", "name": launch, "ts": t, "dur": 5} for t in range(3)),
                             {"ph": "X", "cat": "cuda_runtime", "name": sync, "ts": 9, "dur": 400},
                             _event("kernel", "gemm", 0, 900, 7)]}  # fmt: skip
    calls = runtime_summary(trace)["runtime_calls"]  # host API calls only, most time first
    assert calls == [{"name": sync, "s": pytest.approx(400e-6), "count": 1},
                     {"name": launch, "s": pytest.approx(15e-6), "count": 3}]  # fmt: skip

    def busy() -> int:
        return sum(i * i for i in range(200_000))

    prof = cProfile.Profile()
    prof.enable()
    busy()
    busy()
    prof.disable()
    host = host_summary(pstats.Stats(prof), top=50)
    mine = [e for e in host["host_cumulative"] if e["name"].endswith("(busy)")]
    assert len(mine) == 1 and mine[0]["calls"] == 2 and mine[0]["s"] > 0
    assert "tests/test_bench.py" in mine[0]["name"] or "test_bench.py" in mine[0]["name"]
    assert [e["s"] for e in host["host_self"]] == sorted((e["s"] for e in host["host_self"]), reverse=True)
    row = {"scale": "7B", "seq_len": 512, "method": "poros", "profile_runtime_calls": calls,
           **{f"profile_{k}": v for k, v in host.items()}}  # fmt: skip
    table = host_table([row, {"method": "resident"}], top=1)
    assert table.count("\n") == 1 + 3 and f"`{sync}`" in table and "| runtime |" in table and "(busy)" in table


def test_runs_after_resident_gc_do_not_inherit_its_input_grads_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpointing makes the embeddings' output require grad (a forward hook); a later run on the same model would
    hold that output and its gradient through its update, memory its plan does not count."""
    from poros_lightning.tools.bench import harness

    hooks: list[int] = []
    step_loop = harness.step_loop

    def counting(model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        hooks.append(len(model.get_base_model().get_input_embeddings()._forward_hooks))
        return step_loop(model, *args, **kwargs)

    monkeypatch.setattr(harness, "step_loop", counting)
    runs = [{"method": "resident_gc"}, {"method": "poros"}, {"method": "resident_gc"}]
    harness.bench_methods(tiny_config(), runs, seq_len=8, lora_r=4, steps=1, warmup=1)
    assert hooks == [1, 0, 1]


def test_a_run_may_freeze_the_collector_for_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gc_freeze: true`` runs the steps as PorosStrategy(gc_freeze=True) trains: what exists before them is left out
    of Python's collections; the next run starts thawed."""
    import gc

    from poros_lightning.tools.bench import harness

    frozen: list[int] = []
    step_loop = harness.step_loop

    def counting(model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        frozen.append(gc.get_freeze_count())
        return step_loop(model, *args, **kwargs)

    monkeypatch.setattr(harness, "step_loop", counting)
    runs = [{"method": "poros", "gc_freeze": True}, {"method": "poros"}, {"method": "resident_gc", "gc_freeze": True}]
    rows = harness.bench_methods(tiny_config(), runs, seq_len=8, lora_r=4, steps=1, warmup=1)
    assert [row["gc_freeze"] for row in rows] == [True, False, True]
    assert frozen[0] > 1000 and frozen[1] == 0 and frozen[2] > 1000
    assert gc.get_freeze_count() == 0


def test_gc_timer_counts_the_collections_while_on() -> None:
    import gc

    from poros_lightning.tools.bench.steps import gc_timer

    sink: dict = {}
    with gc_timer(sink) as timing:
        gc.collect()  # off: not counted
        timing(True)
        gc.collect()
        gc.collect(0)
        timing(False)
        gc.collect()
    assert sink["gc_collections"] == [1, 0, 1] and sink["gc_seconds"][2] > 0
    assert all(cb.__name__ != "_hook" for cb in gc.callbacks)  # removed on exit


def test_profile_is_cuda_only(tmp_path: Path) -> None:
    path = _one_step_config(tmp_path, runs=[{"method": "poros"}])
    assert main(["run", str(path), "--profile"]) == 0
    (row,) = map(json.loads, (tmp_path / "bench.jsonl").read_text().splitlines())
    assert row["s_per_step"] > 0 and not any(k.startswith("profile_") for k in row)  # on CPU: none made up
    assert row["gc_s_per_step"] >= 0 and row["gc_full_per_step"] >= 0  # the collector, on any device
    assert len(row["gc_step_s"]) == len(row["step_s"])  # and its seconds in each timed step
    assert sum(row["gc_step_s"]) == pytest.approx(row["gc_s_per_step"] * len(row["step_s"]), abs=1e-3)


def test_report_prints_the_profile_of_profiled_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    phases = {f"profile_{p}_{k}": 0.5 for p in ("forward", "backward", "update") for k in ("s", "busy_s")}
    rows = [{"method": "poros", "s_per_step": 1.0, **phases}, {"method": "resident_gc", "s_per_step": 1.0}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(path), "--profile", "-o", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "| poros | backward | 0.500 | 0.500 | — |" in out and "| resident_gc | forward" not in out
    rows[0].update(profile_kernel_groups={"matmul": 0.25}, profile_top_kernels=[{"name": "a|b", "s": 0.2, "count": 9}])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(path), "--profile", "-o", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "| None | None | poros | matmul | 0.250 |  |" in out and "|  |  |  | `a/b` | 0.200 | 9 |" in out


def test_launch_probe_needs_cuda() -> None:
    import torch

    from poros_lightning.tools.bench.launch_probe import probe

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        probe()


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]


def test_a_refused_budget_is_a_row_and_the_bench_goes_on(tmp_path: Path) -> None:
    from poros_lightning.memory.budget import minimum_budget

    runs = [{"method": "poros", "name": "poros_1KB", "vram_budget": "1KB"}, {"method": "poros"}]
    path = _one_step_config(tmp_path, runs=runs, scale="tiny")
    assert main(["run", str(path)]) == 0
    refused, ran = _rows(tmp_path)
    assert refused["method"] == "poros_1KB" and refused["refused"] is True and refused["oom"] is False
    assert refused["s_per_step"] is None and refused["planned_peak_gb"] is None and refused["vram_budget"] == 1e-6
    cpu = minimum_budget(tiny_config(), seq_len=8, lora_r=4, workspace_bytes=0)  # no cuBLAS workspaces on the CPU
    assert refused["min_budget_gb"] == cpu / 1e9 > 1e-6
    assert "the budget is 1.00 kB" in refused["refusal"] and "plan" not in refused
    assert refused["fix"].startswith("Use vram_budget >= ")  # the strategy's own hint
    assert SWEEP_FIELDS <= set(refused) and refused["scale"] == "tiny" and refused["seq_len"] == 8
    assert ran["method"] == "poros" and ran["refused"] is False and ran["s_per_step"] > 0


def test_a_run_out_of_device_memory_is_a_row_and_the_bench_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from poros_lightning.tools.bench import harness

    step_loop, calls = harness.step_loop, []

    def first_runs_out(*args: object, **kwargs: object) -> list[float]:
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError(  # what the allocator raises past a memory cap
                "CUDA out of memory. Tried to allocate 14.00 MiB.\nOf the allocated memory 1.12 GiB is allocated"
            )
        return step_loop(*args, **kwargs)

    monkeypatch.setattr(harness, "step_loop", first_runs_out)
    path = _one_step_config(
        tmp_path, runs=[{"method": "poros", "name": "poros_8GB", "vram_budget": "8GB"}, {"method": "poros"}]
    )
    assert main(["run", str(path)]) == 0
    oom, ran = _rows(tmp_path)
    assert oom["oom"] is True and oom["refused"] is False and oom["s_per_step"] is None
    assert oom["vram_budget"] == 8.0 and oom["planned_peak_gb"] > 0  # the plan that ran out
    assert SWEEP_FIELDS <= set(oom)
    assert (
        oom["oom_error"]
        == "CUDA out of memory. Tried to allocate 14.00 MiB. Of the allocated memory 1.12 GiB is allocated"
    )
    assert ran["oom"] is False and ran["s_per_step"] > 0 and ran["loads_per_step"] > 0  # the engine unprepared


def test_models_list_and_filters(tmp_path: Path) -> None:
    """One config, several models; --models, --seq-lens and --runs pick the pieces to run."""
    models = [
        {"model_config": tiny_config(), "scale": "tinyA"},
        {"model_config": tiny_config(num_hidden_layers=2), "scale": "tinyB", "seq_lens": [16]},
    ]
    runs = [{"method": "resident_gc"}, {"method": "poros", "name": "poros_1KB", "vram_budget": "1KB"}]
    path = _one_step_config(tmp_path, models=models, runs=runs)
    cfg = yaml.safe_load(path.read_text())
    del cfg["model_config"]  # each entry of `models` names its own
    path.write_text(yaml.safe_dump(cfg))
    assert [e["scale"] for e in model_entries(load_bench_config(path))] == ["tinyA", "tinyB"]
    assert main(["run", str(path), "--models", "tinyb", "--runs", "resident_gc"]) == 0
    assert [(r["scale"], r["seq_len"], r["method"]) for r in _rows(tmp_path)] == [("tinyB", 16, "resident_gc")]
    (tmp_path / "bench.jsonl").unlink()
    assert main(["run", str(path), "--seq-lens", "4", "--runs", "poros_1KB"]) == 0  # refusals only: no model runs
    rows = _rows(tmp_path)
    assert [(r["scale"], r["seq_len"], r["refused"]) for r in rows] == [("tinyA", 4, True), ("tinyB", 4, True)]
    assert rows[0]["model"] == "qwen2 (random init)" and len({r["run_id"] for r in rows}) == 1
    with pytest.raises(PorosConfigError, match="No model 70b"):
        main(["run", str(path), "--models", "70B"])


@pytest.mark.parametrize(
    ("edits", "match"),
    [
        ({"models": [{"model_config": {}, "steps_": 1}]}, "steps_"),
        ({"models": [{"scale": "x"}]}, "names no model"),
        ({"models": []}, "non-empty list"),
        ({"models": [{"model": "Qwen/Qwen2.5-7B"}], "model": "Qwen/Qwen2.5-7B"}, "both `models` and"),
        ({"models": [{"model": "Qwen/Qwen2.5-7B", "build": "fast"}]}, "Unknown build 'fast'"),
    ],
)
def test_models_list_is_validated(tmp_path: Path, edits: dict, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"runs": [{"method": "poros"}], **edits}))
    with pytest.raises(PorosConfigError, match=match):
        load_bench_config(path)


BENCH_CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs" / "bench").glob("*.yaml"))


@pytest.mark.parametrize("path", BENCH_CONFIGS, ids=lambda p: p.name)
def test_shipped_bench_configs_load(path: Path) -> None:
    from poros_lightning.tools.check import load_config

    assert path.read_text().splitlines()[0] == f"# poros-lightning bench run configs/bench/{path.name}"
    cfg = load_bench_config(path)
    for entry in model_entries(cfg):
        config, source = load_config(entry["model"])
        assert source == "bundled config facts" and config["model_type"]
    names = [r.get("name", r["method"]) for r in cfg["runs"]]
    assert len(set(names)) == len(names) and cfg["out"].startswith("docs/benchmarks/")


def test_planner_sweep_config() -> None:
    from poros_lightning.memory.planner import parse_bytes

    cfg = load_bench_config(BENCH_CONFIGS[0].parent / "planner-sweep.yaml")
    entries = model_entries(cfg)
    assert [e["model"] for e in entries] == [f"Qwen/Qwen2.5-{s}" for s in ("7B", "32B", "72B")]
    assert all(e["seq_lens"] == [512, 2048, 4096] for e in entries)
    assert {"method": "resident_gc"} in cfg["runs"]
    assert [parse_bytes(r["vram_budget"]) / 1e9 for r in cfg["runs"] if "vram_budget" in r] == [6, 8, 12, 16, 24]
    assert cfg["out"] == "docs/benchmarks/planner_sweep.jsonl"


def _sweep_rows() -> list[dict]:
    base = {"run_id": "r", "model": "Qwen/Qwen2.5-72B (random init)", "scale": "72B", "seq_len": 2048}
    poros = {**base, "base_method": "poros", "refused": False, "oom": False}
    return [
        {**base, "method": "resident_gc", "base_method": "resident_gc", "vram_budget": None, "s_per_step": 2.0},
        {
            **poros,
            "method": "poros_6GB",
            "vram_budget": 6.0,
            "refused": True,
            "min_budget_gb": 7.54,
            "s_per_step": None,
        },
        {**poros, "method": "poros_8GB", "vram_budget": 8.0, "oom": True, "s_per_step": None, "planned_peak_gb": 7.1},
        {
            **poros,
            "method": "poros_12GB",
            "vram_budget": 12.0,
            "s_per_step": 2.5,
            "planned_peak_gb": 10.5,
            "peak_vram_gb": 9.9,
            "peak_reserved_gb": 10.8,
            "embeddings_on_host": True,
            "resident_blocks": 3,
        },
        {**poros, "method": "poros_24GB", "vram_budget": "24GB", "s_per_step": 2.2, "resident_blocks": 22},  # older row
        {**base, "seq_len": 512, "method": "poros", "base_method": "poros", "s_per_step": 1.0},  # no budget: no plot
    ]


def test_report_plots_s_per_step_against_the_budget(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from poros_lightning.tools.bench.report import load_rows, render_html
    from poros_lightning.tools.bench.sweep import sweep_groups

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _sweep_rows()))
    rows = load_rows([path])
    assert list(sweep_groups(rows)) == [("72B", 2048)]
    page = render_html(rows)
    assert page.count('<svg xmlns="http://www.w3.org/2000/svg" class="budget-sweep"') == 1
    assert "<h3>72B, seq 2048</h3>" in page
    assert page.count('class="reference resident_gc"') == 1 and "resident_gc: 2.000 s/step" in page
    assert page.count('class="point measured"') == 2 and 'class="measured" points=' in page  # 12 and 24 GB
    assert (
        page.count('class="point refused"') == 1 and "6 GB: refused by the planner (smallest budget 7.540 GB)" in page
    )
    assert page.count('class="point oom"') == 1 and "8 GB: out of device memory" in page
    assert 'class="minimum-budget"' in page
    assert "12 GB: 2.500 s/step x1.250 resident_gc" in page and "host: embeddings; 3 resident blocks" in page
    # The table beside the plot and the full table name the refusal too.
    assert "<td>refused (needs 7.540 GB)</td>" in page and "<td>out of memory</td>" in page
    assert main(["report", str(path), "-o", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "| 72B | 2048 | 6 | — | — | — | — | — | refused (needs 7.540 GB) | — | — |" in out
    # The estimate over the allocated peak (10.5 / 9.9), and s/step against the next smaller budget that ran.
    assert (
        "| 72B | 2048 | 12 | host: embeddings; 3 resident blocks | 10.5 | 9.900 | 10.8 | 1.061 | 2.500 | 1.250 | — |"
        in out
    )
    assert "| 72B | 2048 | 24 | 22 resident blocks | — | — | — | — | 2.200 | 1.100 | 0.880 |" in out
    assert 'class="point oom"' in (tmp_path / "r.html").read_text()
    assert "budget-sweep" not in render_html(rows[-1:])  # rows without budgets: no sweep section


def test_runs_take_batch_accumulation_and_block_major_micro_batches(tmp_path: Path) -> None:
    """Realistic recipes: rows carry the effective batch; block-major loads each block once for all micro-batches."""
    cfg = {
        "model": "tiny-qwen2",
        "model_config": tiny_config(),
        "scale": "tiny",
        "seq_lens": [16],
        "batch_size": 2,
        "lora_r": 4,
        "steps": 2,
        "warmup": 1,
        "runs": [
            {"method": "resident_gc", "name": "resident_gc_accum", "accumulate": 4},
            {"method": "poros", "name": "poros_accum", "accumulate": 4},
            {"method": "poros", "name": "poros_block_major", "micro_batches": 4},
            {"method": "poros", "name": "poros_batch", "accumulate": 1},
        ],
        "out": str(tmp_path / "bench.jsonl"),
    }
    rows = {r["method"]: r for r in _run(tmp_path, cfg)}
    for name in ("resident_gc_accum", "poros_accum", "poros_block_major"):
        assert rows[name]["effective_batch"] == 8, name
        assert rows[name]["tokens_per_s"] == pytest.approx(8 * 16 / rows[name]["s_per_step"])
    assert (rows["poros_accum"]["accumulate"], rows["poros_accum"]["micro_batches"]) == (4, 1)
    assert (rows["poros_block_major"]["accumulate"], rows["poros_block_major"]["micro_batches"]) == (1, 4)
    assert rows["poros_batch"]["effective_batch"] == 2
    # The base crosses the link once per step block-major, once per micro-batch sample-major (less the block
    # the ring keeps between a forward and its backward).
    assert rows["poros_accum"]["loads_per_step"] > 3 * rows["poros_block_major"]["loads_per_step"]
    assert rows["poros_block_major"]["loads_per_step"] == rows["poros_batch"]["loads_per_step"]


@pytest.mark.parametrize(
    ("run", "match"),
    [
        ({"method": "resident", "micro_batches": 2}, "sets micro_batches with method 'resident'"),
        ({"method": "poros", "accumulate": 0}, "must be a positive integer"),
        ({"method": "poros", "micro_batches": 1.5}, "must be a positive integer"),
    ],
)
def test_accumulation_keys_are_validated(tmp_path: Path, run: dict, match: str) -> None:
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump({"model": "Qwen/Qwen2.5-0.5B", "runs": [run]}))
    with pytest.raises(PorosConfigError, match=match):
        load_bench_config(path)


def test_a_planned_run_reads_a_config_that_leaves_keys_to_the_defaults(tmp_path: Path) -> None:
    """No vocab_size in the config: the planner plans with the transformers default, as the model is built."""
    config = {k: v for k, v in tiny_config().items() if k != "vocab_size"}
    cfg = {
        "model_config": config,
        "scale": "tiny",
        "seq_lens": [16],
        "lora_r": 4,
        "steps": 1,
        "warmup": 1,
        "runs": [{"method": "poros", "name": "planned", "vram_budget": "4GB"}],
        "out": str(tmp_path / "bench.jsonl"),
    }
    (row,) = _run(tmp_path, cfg)
    assert row["s_per_step"] > 0 and row["planned_peak_gb"] > 0


def test_report_compares_rows_of_one_effective_batch_and_counts_its_tokens(tmp_path: Path) -> None:
    from poros_lightning.tools.bench.report import ratio_table

    common = {"run_id": "r", "model": "m", "seq_len": 10, "batch_size": 1}
    rows = [
        {**common, "method": "resident_gc", "s_per_step": 1.0, "effective_batch": 1},
        {**common, "method": "poros", "s_per_step": 2.0, "effective_batch": 1},
        {**common, "method": "resident_gc", "s_per_step": 4.0, "effective_batch": 4, "accumulate": 4},
        {**common, "method": "poros", "s_per_step": 4.0, "effective_batch": 4, "micro_batches": 4},
    ]
    table = ratio_table(rows, "resident_gc")
    lines = [line for line in table.splitlines()[2:]]
    assert len(lines) == 4
    poros_4 = [line for line in lines if "| poros |" in line][1]
    cells = [c.strip() for c in poros_4.strip("|").split("|")]
    assert float(cells[6]) == 10.0  # 4 rows x 10 tokens / 4 s
    assert float(cells[8]) == 1.0  # against resident_gc at the same effective batch, not at batch 1


def test_bench_runs_take_a_chunked_loss(tmp_path: Path) -> None:
    """loss_chunk_tokens: the head and the loss in chunks, resident, streamed and block-major; the planner sizes one
    chunk's logits. The chunked loss is the unchunked one within float32 rounding (Note: [chunked vs unchunked])."""
    import torch
    from conftest import build_peft_model

    from poros_lightning.tools.bench.steps import chunked_token_loss
    from poros_lightning.tools.parity.runner import token_loss

    model = build_peft_model(lora_dropout=0.0)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    whole = token_loss(model(input_ids=ids, use_cache=False).logits, ids)
    assert torch.allclose(chunked_token_loss(model, ids, 7), whole, rtol=1e-5)
    cfg = {
        "model": "tiny-qwen2",
        "model_config": tiny_config(),
        "scale": "tiny",
        "seq_lens": [16],
        "lora_r": 4,
        "batch_size": 2,
        "steps": 1,
        "warmup": 1,
        "runs": [
            {"method": "resident_gc", "accumulate": 2, "loss_chunk_tokens": 8},
            {"method": "poros", "name": "bm", "micro_batches": 2, "loss_chunk_tokens": 8},
            {"method": "poros", "name": "planned", "vram_budget": "4GB", "micro_batches": 2, "loss_chunk_tokens": 8},
        ],
        "out": str(tmp_path / "bench.jsonl"),
    }
    rows = {r["method"]: r for r in _run(tmp_path, cfg)}
    assert all(r["s_per_step"] > 0 and r["loss_chunk_tokens"] == 8 and r["effective_batch"] == 4 for r in rows.values())
    assert any("in chunks of 8 tokens" in line for line in rows["planned"]["plan"])
    bad = {**cfg, "runs": [{"method": "poros", "loss_chunk_tokens": 0}]}
    with pytest.raises(PorosConfigError, match="loss_chunk_tokens"):
        _run(tmp_path, bad)


def test_resident_paged_adamw_is_a_run_and_a_refused_row_off_cuda(tmp_path: Path) -> None:
    """The common resident QLoRA recipe (gradient checkpointing, bitsandbytes' paged 8-bit AdamW) as a peer run; off
    CUDA it is recorded as a refused row and the runs after it go on."""
    cfg = {
        "model": "tiny-qwen2",
        "model_config": tiny_config(),
        "scale": "tiny",
        "seq_lens": [16],
        "lora_r": 4,
        "steps": 1,
        "warmup": 1,
        "runs": [
            {"method": "resident_gc", "name": "resident_gc_paged_adamw_8bit", "optimizer": "paged_adamw_8bit"},
            {"method": "resident_gc"},
        ],
        "out": str(tmp_path / "bench.jsonl"),
    }
    paged, plain = _run(tmp_path, cfg)
    assert paged["refused"] and "CUDA only" in paged["refusal"] and paged["optimizer"] == "paged_adamw_8bit"
    assert plain["s_per_step"] > 0 and plain["optimizer"] == "adamw"
    with pytest.raises(PorosConfigError, match="optimizer"):
        _run(tmp_path, {**cfg, "runs": [{"method": "resident_gc", "optimizer": "sgd"}]})


def test_sweep_groups_keep_effective_batches_apart() -> None:
    """A 16-sample resident step is no reference for a one-sample plan: each effective batch is its own group."""
    from poros_lightning.tools.bench.sweep import sweep_groups

    one = {"scale": "72B", "seq_len": 512, "gpu": "NVIDIA H100 80GB HBM3"}
    rows = [
        {**one, "method": "resident_gc", "base_method": "resident_gc", "s_per_step": 0.9},
        {**one, "method": "poros_24GB", "base_method": "poros", "vram_budget": 24.0, "s_per_step": 1.3},
        {**one, "method": "resident_gc_x16", "base_method": "resident_gc", "effective_batch": 16, "s_per_step": 17.5},
        {**one, "method": "poros_min_bm16", "base_method": "poros", "vram_budget": 6.15, "effective_batch": 16},
    ]
    groups = sweep_groups(rows)
    assert sorted(groups) == [("72B on H100", 512), ("72B x16 on H100", 512)]
    assert [r["method"] for r in groups[("72B on H100", 512)]] == ["resident_gc", "poros_24GB"]
    assert [r["method"] for r in groups[("72B x16 on H100", 512)]] == ["resident_gc_x16", "poros_min_bm16"]


def test_support_table_cell_of_a_plan_run_alone(tmp_path: Path) -> None:
    """The newest run of a plan fills its cell even without resident_gc beside it: with no ratio, said so."""
    from poros_lightning.tools.support_table import _bench

    bench = tmp_path / "docs" / "benchmarks"
    bench.mkdir(parents=True)
    one = {"model": "m (random init)", "seq_len": 512, "batch_size": 1, "gpu": "NVIDIA H100 80GB HBM3"}
    rows = [
        {**one, "run_id": "a", "method": "resident_gc", "s_per_step": 0.5, "peak_vram_gb": 5.0},
        {**one, "run_id": "a", "method": "poros_min", "oom": True, "planned_peak_gb": 1.1, "vram_budget": 1.3},
        {**one, "run_id": "b", "method": "poros_min", "s_per_step": 0.42, "peak_vram_gb": 1.25},
    ]
    (bench / "families.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = _bench(tmp_path, "m")
    assert cells["min-memory plan"] == "0.420 s (no resident_gc in its run), 1.2 GB, H100"
    assert cells["resident_gc"] == "0.500 s, 5.0 GB, H100"


def test_oom_fields_lay_out_the_allocator_per_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """An out-of-memory row says where the reserved memory sits: per segment, its stream, mapped size, what is
    allocated and its free pieces (the bench reads them at the failed allocation through an OOM observer)."""
    import torch

    from poros_lightning.tools.bench.oom import free_blocks

    mb = 2**20
    snapshot = [
        {
            "stream": 0,
            "is_expandable": True,
            "segment_type": "large",
            "total_size": 600 * mb,
            "allocated_size": 100 * mb,
            "blocks": [
                {"size": 100 * mb, "state": "active_allocated"},
                {"size": 300 * mb, "state": "inactive"},
                {"size": 200 * mb, "state": "inactive"},
            ],
        },
        {
            "stream": 7,
            "is_expandable": True,
            "segment_type": "large",
            "total_size": 40 * mb,
            "allocated_size": 0,
            "blocks": [{"size": 40 * mb, "state": "active_pending_free"}],
        },
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)
    fields = free_blocks()
    assert fields["oom_segments"] == 2 and fields["oom_expandable"]
    assert fields["oom_largest_free_mb"] == 300 and fields["oom_pending_free_mb"] == 40
    assert fields["oom_segment_table"][0] == {
        "stream": 0,
        "expandable": True,
        "pool": "large",
        "mb": 600.0,
        "allocated_mb": 100.0,
        "free_pieces": 2,
        "largest_free_mb": 300.0,
    }
    assert fields["oom_segment_table"][1]["free_pieces"] == 0


def test_the_link_probe_gives_its_buffer_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The link probe empties the cache after freeing its buffer (Note: [the probe's segment]); switching on
    expandable segments does too, so no tensor lands in a fixed segment cached before."""
    import logging

    import torch

    from poros_lightning.engine.link import measure_h2d
    from poros_lightning.lightning.planning import use_expandable_segments

    calls: list[str] = []
    real_empty = torch.empty
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: calls.append(s), raising=False)
    monkeypatch.setattr(torch, "empty", lambda n, dtype=None, **kw: real_empty(n, dtype=dtype))  # on the CPU
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert measure_h2d(nbytes=1 << 10, repeats=1) > 0
    assert calls == ["empty_cache"]
    assert use_expandable_segments(torch.device("cuda", 0), logging.getLogger("test"))
    assert calls == ["empty_cache", "expandable_segments:True", "empty_cache"]


def test_the_estimate_ratio_prices_the_plan_each_step_ran() -> None:
    """A tuner that grows a plan measures a larger peak than the starting plan's estimate: each measured step is
    compared with its own plan's estimate, and the timed steps' plan with the row's peak when nothing larger ran."""
    from poros_lightning.tools.bench.sweep import estimate_ratio

    old = {"planned_peak_gb": 9.0, "peak_vram_gb": 10.0, "tuned": [{"peak_allocated_gb": 10.0}]}
    assert estimate_ratio(old) == pytest.approx(0.9)  # rows without priced steps: the starting plan
    grown = {
        "planned_peak_gb": 9.0,
        "peak_vram_gb": 10.2,
        "final_planned_peak_gb": 11.0,
        "tuned": [
            {"planned_gb": 9.0, "peak_allocated_gb": 8.0},
            {"planned_gb": 11.0, "peak_allocated_gb": 10.0},
        ],
    }
    assert estimate_ratio(grown) == pytest.approx(11.0 / 10.2)  # the final plan against the timed steps' peak
    fell_back = {**grown, "final_planned_peak_gb": 9.0}  # a larger plan ran: it may have set the row's peak
    assert estimate_ratio(fell_back) == pytest.approx(11.0 / 10.0)  # the steps alone
    assert estimate_ratio({"planned_peak_gb": None, "peak_vram_gb": 3.0}) is None


def test_estimates_price_a_budget_this_version_refuses_by_its_smallest_plan() -> None:
    """A minimum plan measured at a budget the memory model now refuses (it counts more) is priced as the smallest
    plan with the same host-side options, not left out."""
    from poros_lightning.arch import known_config
    from poros_lightning.errors import PorosOOMError
    from poros_lightning.memory.budget import minimum_budget
    from poros_lightning.memory.planner import plan_engine
    from poros_lightning.tools.bench.estimates import estimate_rows

    cfg = known_config("Qwen/Qwen2.5-7B")
    kw = dict(seq_len=512, micro_batches=16, loss_chunk_tokens=64)
    with pytest.raises(PorosOOMError):
        plan_engine(cfg, int(2.14e9), **kw)
    smallest = plan_engine(cfg, minimum_budget(cfg, **kw), **kw)
    on = dict.fromkeys(("embeddings_on_host", "head_on_host", "optimizer_on_host", "inputs_on_host"), True)
    row = {
        "run_id": "2026-12-07T05:55:07-1", "gpu": "card", "model": "Qwen/Qwen2.5-7B (random init)", "scale": "7B",
        "batch_size": 1, "lora_r": 16, "vram_budget": 2.14, "block_mb": 120.22,
        "peak_vram_gb": 1.914, "keep_activations": 0, "resident_blocks": 0, **kw, **on,
    }  # fmt: skip
    (priced,) = estimate_rows([row])
    assert priced["estimate_gb"] == pytest.approx(smallest.vram_estimate / 1e9)
    assert priced["ratio"] == pytest.approx(smallest.vram_estimate / 1.914e9) and priced["ratio"] > 1.0
    assert estimate_rows([{**row, "inputs_on_host": False}]) == []  # another plan than the smallest: not priced


def test_estimates_price_every_measured_plan_with_todays_model(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """``bench report --estimates``: each tuned step's plan and the timed steps' plan, priced by plan_engine."""
    import json

    from poros_lightning.arch import known_config
    from poros_lightning.memory.planner import plan_engine
    from poros_lightning.tools.bench.cli import main
    from poros_lightning.tools.bench.estimates import estimate_rows

    plan = plan_engine(known_config("Qwen/Qwen2.5-7B"), int(16e9), seq_len=2048)
    assert not plan.optimizer_on_host
    block_mb = 117.0
    row = {
        "run_id": "2026-12-05T19:09:17-1", "gpu": "card", "model": "Qwen/Qwen2.5-7B (random init)", "scale": "7B",
        "method": "poros_16GB",
        "seq_len": 2048, "batch_size": 1, "lora_r": 16, "vram_budget": 16.0, "block_mb": block_mb,
        "peak_vram_gb": 14.0, "keep_activations": plan.keep_activations + 2, "resident_blocks": plan.resident_blocks,
        "tuned": [  # the first step's peak has no optimizer moments yet (they come with its update): not priced
            {"keep_activations": plan.keep_activations, "resident_blocks": plan.resident_blocks, "peak_allocated_gb": 9.0},
            {"keep_activations": plan.keep_activations, "resident_blocks": plan.resident_blocks, "peak_allocated_gb": 12.0},
            {"keep_activations": plan.keep_activations + 2, "resident_blocks": plan.resident_blocks, "peak_allocated_gb": 13.5},
        ],
    }  # fmt: skip
    other = {**row, "optimizer_on_host": True}  # another plan than today's for that budget: not priced
    first, second, timed = estimate_rows([row, other, {**row, "vram_budget": None}])
    assert first["estimate_gb"] == pytest.approx(plan.vram_estimate / 1e9)
    grown = (plan.vram_estimate + 2 * plan.activation_layer_bytes) / 1e9
    assert second["estimate_gb"] == timed["estimate_gb"] == pytest.approx(grown)
    assert (first["measured_gb"], second["measured_gb"], timed["measured_gb"]) == (12.0, 13.5, 14.0)
    assert timed["ratio"] == pytest.approx(grown / 14.0)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "run_id": "2026-12-01T00:00:00"}) + "\n")
    main(["report", str(path), "-o", str(tmp_path / "r.html"), "--estimates", "--since", "2026-12-05"])
    out = capsys.readouterr().out
    assert "3 measured plans" in out and "2026-12-01" not in out


def test_a_step_that_raises_leaves_no_optimizer_hook_on_the_model() -> None:
    """The bench reuses one model for every run: a run whose step raises (out of memory) with the optimizer state in
    host memory removes its trigger hook from the adapter all the same, so the next run does not carry it."""
    import torch
    from conftest import build_peft_model

    from poros_lightning.tools.bench.steps import step_loop

    model = build_peft_model(lora_dropout=0.0)
    trained = [p for p in model.parameters() if p.requires_grad]

    def hooks() -> int:
        return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in trained)

    good = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    step_loop(model, [good, good], 1, 256, "cpu", optimizer_on_host=True)
    assert hooks() == 0
    bad = torch.full((2, 16), 10**6)  # past the vocabulary: the forward raises mid-step, after the hook was set
    with pytest.raises(IndexError):
        step_loop(model, [good, bad], 1, 256, "cpu", optimizer_on_host=True)
    assert hooks() == 0


def test_every_run_row_carries_the_hosts_own_speed(tmp_path: Path) -> None:
    """host_launch_us and host_python_ns, measured before each run's steps, in microseconds and nanoseconds."""
    assert main(["run", str(_one_step_config(tmp_path, runs=[{"method": "resident_gc"}, {"method": "poros"}]))]) == 0
    for row in _rows(tmp_path):
        assert 0 < row["host_launch_us"] < 10_000 and 0 < row["host_python_ns"] < 10_000


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_bf16_mixed_runs_each_forward_under_autocast(precision: str) -> None:
    """``precision: bf16-mixed`` in a bench run: the forward and its loss under bf16 autocast, as
    ``Trainer(precision="bf16-mixed")`` runs them; the default runs without."""
    import torch
    from conftest import build_peft_model

    from poros_lightning.tools.bench.steps import step_loop

    model = build_peft_model(lora_dropout=0.0)
    seen: list[bool] = []
    lora = next(m for name, m in model.named_modules() if name.endswith("lora_A.default"))
    lora.register_forward_pre_hook(lambda module, args: seen.append(torch.is_autocast_enabled("cpu")))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert len(step_loop(model, [ids, ids], 1, 256, "cpu", precision=precision)) == 1
    assert seen and all(s == (precision == "bf16-mixed") for s in seen)


def test_a_bench_run_names_its_precision(tmp_path: Path) -> None:
    cfg = {
        "model": "tiny-qwen2", "model_config": tiny_config(), "scale": "tiny", "seq_lens": [16], "lora_r": 4,
        "steps": 1, "warmup": 1, "runs": [{"method": "poros", "name": "amp", "precision": "bf16-mixed"}],
        "out": str(tmp_path / "bench.jsonl"),
    }  # fmt: skip
    (row,) = _run(tmp_path, cfg)
    assert row["precision"] == "bf16-mixed" and row["s_per_step"] > 0
    with pytest.raises(PorosConfigError, match="precision: 32-true"):
        _run(tmp_path, {**cfg, "runs": [{"method": "poros", "precision": "16-mixed"}]})
