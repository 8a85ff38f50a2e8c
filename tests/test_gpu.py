"""GPU gates (run on a CUDA machine; skipped on CPU).

Set ``POROS_ARTIFACTS=DIR`` to keep the raw JSONL: ``DIR/validation/*.jsonl`` and
``DIR/benchmarks/*.jsonl`` (committed copies live under docs/validation and docs/benchmarks).

    POROS_ARTIFACTS=docs CUBLAS_WORKSPACE_CONFIG=:4096:8 pytest -m gpu tests/test_gpu.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from poros_lightning.arch.known import known_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _artifacts(tmp_path: Path, kind: str, name: str) -> Path:
    root = Path(os.environ.get("POROS_ARTIFACTS", tmp_path))
    return root / kind / name


def test_parity_1b_dropout(tmp_path: Path) -> None:
    """Four surfaces torch.equal on a >= 1B random-init Qwen2.5 with LoRA dropout, more blocks than slots."""
    from poros_lightning.parity.runner import run_parity

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    config = known_config("Qwen/Qwen2.5-1.5B")
    result = run_parity(
        config,
        model="Qwen/Qwen2.5-1.5B (random init)",
        scale="1.5B",
        steps=int(os.environ.get("POROS_GPU_STEPS", "20")),
        mode="dropout",
        block_size=1,
        seq_len=512,
        out=_artifacts(tmp_path, "validation", "engine_qwen2.5-1.5b_dropout.jsonl"),
    )
    assert result.equal, result.first_mismatch


def test_bench_7b_resident_vs_streamed(tmp_path: Path) -> None:
    """Peak VRAM and s/step at Qwen2.5-7B scale, seq 512, LoRA r16, batch 1, every method on one build."""
    from poros_lightning.bench.harness import bench_methods, measure_h2d, write_jsonl

    config = known_config("Qwen/Qwen2.5-7B")
    h2d = measure_h2d()
    runs = [{"method": "resident"}, {"method": "resident_gc"}, {"method": "poros"}]
    rows = [
        {
            "model": "Qwen/Qwen2.5-7B (random init)",
            "scale": "7B",
            "pinned_peak_h2d_gbps": h2d,
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            **row,
        }
        for row in bench_methods(config, runs, seq_len=512, lora_r=16, steps=8, warmup=3)
    ]
    write_jsonl(rows, _artifacts(tmp_path, "benchmarks", "engine_qwen2.5-7b.jsonl"))
    by = {r["method"]: r for r in rows}
    # streamed training keeps only the resident modules, adapters and two slots on the GPU
    assert by["poros"]["peak_vram_gb"] < 0.5 * by["resident"]["peak_vram_gb"]
    assert by["poros"]["peak_vram_gb"] < by["resident_gc"]["peak_vram_gb"]
    # the copies run at (close to) the pinned bandwidth measured in the same run
    assert by["poros"]["h2d_copy_gbps"] > 0.8 * h2d


def test_min_memory_7b_parity_and_peak(tmp_path: Path) -> None:
    """Embeddings, LM head and optimizer moments in host memory: exact, and the peak drops by about the head."""
    from poros_lightning.bench.harness import bench_methods
    from poros_lightning.parity.runner import run_parity

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    config = known_config("Qwen/Qwen2.5-7B")  # untied: the head can leave the device
    result = run_parity(
        config,
        model="Qwen/Qwen2.5-7B (random init)",
        scale="7B",
        steps=int(os.environ.get("POROS_GPU_STEPS", "5")),
        mode="min_memory",
        seq_len=512,
        out=_artifacts(tmp_path, "validation", "parity_qwen2.5-7b_min_memory.jsonl"),
    )
    assert result.equal, result.first_mismatch
    runs = [
        {"method": "poros", "name": "poros_min", "embeddings_on_host": True},
        {"method": "poros", "name": "poros_min_head", "embeddings_on_host": True, "head_on_host": True},
    ]
    by = {r["method"]: r for r in bench_methods(config, runs, seq_len=512, lora_r=16, steps=3, warmup=2)}
    head_gb = config["vocab_size"] * config["hidden_size"] * 2 / 1e9
    assert by["poros_min_head"]["head_loads_per_step"] == 2
    assert by["poros_min"]["peak_vram_gb"] - by["poros_min_head"]["peak_vram_gb"] > 0.5 * head_gb
