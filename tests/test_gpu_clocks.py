"""The bench's GPU clock sampler (tools/bench/gpu_clocks.py): parsing nvidia-smi's samples, and running it."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from poros_lightning.tools.bench.gpu_clocks import ClockSampler, summarize

UUID = "GPU-5a1c0b2e-0000-4000-8000-000000000001"
OTHER = "GPU-5a1c0b2e-0000-4000-8000-000000000002"


def test_summary_keeps_the_gpus_own_samples_and_names_the_reasons() -> None:
    lines = [
        f"{UUID}, 1980, 512.30, 51, 0x0000000000000000",
        f"{OTHER}, 345, 70.00, 30, 0x0000000000000001",  # another GPU of the host: not this one's
        f"{UUID}, 1755, 699.90, 55, 0x0000000000000004",  # held down by the power cap
        f"{UUID}, [N/A], 600.00, 55, 0x0000000000000000",  # no clock read: no sample
        "garbage",
        f"{UUID}, 1410, [Not Supported], 61, 0x0000000000000024",  # power cap and thermal slowdown
    ]
    got = summarize(lines, UUID.removeprefix("GPU-").upper())
    assert got == {
        "samples": 3,
        "sm_mhz_min": 1410.0,
        "sm_mhz_mean": 1715.0,
        "sm_mhz_max": 1980.0,
        "power_w_max": 699.9,
        "temp_c_max": 61.0,
        "reasons": {"sw_power_cap": 0.667, "sw_thermal_slowdown": 0.333},
    }
    assert summarize(lines)["samples"] == 4  # no UUID: every GPU's
    assert summarize([f"{OTHER}, 345, 70.00, 30, 0x1"], UUID) is None


def _fake_smi(tmp_path: Path, lines: list[str]) -> str:
    """An executable that prints ``lines`` once, then waits to be stopped, as ``nvidia-smi --loop-ms`` does."""
    script = tmp_path / "nvidia-smi"
    body = "\n".join(f"echo '{line}'" for line in lines)
    script.write_text(f"#!/bin/sh\ntest \"$1\" = '--query-gpu=uuid,clocks.sm,power.draw,temperature.gpu,"
                      f"clocks_throttle_reasons.active' || exit 2\n{body}\nexec sleep 60\n")  # fmt: skip
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.skipif(os.name != "posix", reason="a shell script stands in for nvidia-smi")
def test_the_sampler_collects_between_start_and_stop(tmp_path: Path) -> None:
    command = _fake_smi(tmp_path, [f"{UUID}, 1980, 500, 50, 0x0", f"{UUID}, 1600, 690, 52, 0x4"])
    sampler = ClockSampler(UUID, period_ms=10, command=command)
    sampler.start()
    deadline = time.monotonic() + 10
    while os.fstat(sampler._out.fileno()).st_size < 60:  # both lines written
        assert time.monotonic() < deadline, "the fake nvidia-smi printed nothing"
        time.sleep(0.02)
    got = sampler.stop()
    assert got is not None and got["samples"] == 2 and got["sm_mhz_min"] == 1600.0
    assert got["reasons"] == {"sw_power_cap": 0.5}
    assert sampler.stop() is None  # stopped: nothing more, and no process left behind


def test_no_nvidia_smi_is_no_summary_and_no_error(tmp_path: Path) -> None:
    sampler = ClockSampler(UUID, command=str(tmp_path / "absent"))
    sampler.start()
    assert sampler.stop() is None


def test_report_prints_each_rows_steps_beside_the_gpus_clocks(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    from poros_lightning.tools.bench.cli import main

    base = {"run_id": "2026-12-07T21:00:00-1", "scale": "72B", "seq_len": 512, "s_per_step": 1.5, "oom": False}
    slowed = {"sm_mhz_min": 1410.0, "sm_mhz_mean": 1715.0, "sm_mhz_max": 1980.0, "power_w_max": 699.9,
              "temp_c_max": 61.0, "samples": 40, "reasons": {"sw_power_cap": 0.667}}  # fmt: skip
    rows = [
        {**base, "method": "poros_16GB", "round": 1, "step_s": [1.4, 1.5, 1.6], "gpu_clocks": slowed},
        {**base, "method": "poros_cpu", "step_s": [2.0], "gpu_clocks": None},
        {**base, "method": "older"},  # a row from before step_s: not in the table
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(path), "--clocks", "-o", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out.split("| run | scale | seq | method | round |")[1]
    assert (
        "| 2026-12-07T21:00:00-1 | 72B | 512 | poros_16GB | 1 | 1.500 | 1.400 1.500 1.600 | 1410.0 / 1715.0 / 1980.0 "
        "| 699.9 | 61.0 | sw_power_cap 0.67 |"
    ) in out
    assert "| poros_cpu | — | 1.500 | 2.000 | — | — | — | — |" in out and "| older |" not in out
