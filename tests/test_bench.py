"""The bench harness on CPU: every method and option runs end to end and records what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import tiny_config

from poros_lightning.bench.cli import load_bench_config, main
from poros_lightning.errors import PorosConfigError


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
        ],
        "out": str(tmp_path / "bench.jsonl"),
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(path)]) == 0
    rows = {r["method"]: r for r in map(json.loads, (tmp_path / "bench.jsonl").read_text().splitlines())}
    assert list(rows) == ["resident", "resident_gc", "poros", "poros_min", "poros_planned"]
    assert all(r["s_per_step"] > 0 and not r["oom"] for r in rows.values())
    assert all(0 < r["host_issue_s_per_step"] <= r["s_per_step"] for r in rows.values())
    assert rows["poros_min"]["head_loads_per_step"] == 2 and rows["poros_min"]["optimizer_on_host"]
    assert rows["poros"]["loads_per_step"] > 0 and "head_loads_per_step" not in rows["poros"]
    assert rows["poros_planned"]["plan"][-1].startswith("budget 4.00 GB")
    assert rows["poros_planned"]["resident_blocks"] == 2  # a tiny model: all but the two ring blocks stay


def test_bench_config_rejects_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"runs": [{"method": "poros"}], "seqlen": 5}))
    with pytest.raises(PorosConfigError, match="seqlen"):
        load_bench_config(path)


def test_rounds_interleave_the_methods(tmp_path: Path) -> None:
    cfg = {
        "model_config": tiny_config(),
        "seq_lens": [8],
        "lora_r": 4,
        "steps": 1,
        "warmup": 1,
        "rounds": 2,
        "runs": [{"method": "resident_gc"}, {"method": "poros"}],
        "out": str(tmp_path / "bench.jsonl"),
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [(r["method"], r["round"]) for r in rows] == [
        ("resident_gc", 0),
        ("poros", 0),
        ("resident_gc", 1),
        ("poros", 1),
    ]
    assert len({r["run_id"] for r in rows}) == 1
