"""``poros-lightning doctor``: runs on CPU-only machines, reports what is missing with a HINT."""

from __future__ import annotations

import sys

import pytest
import torch

from poros_lightning.tools import doctor as doctor_module
from poros_lightning.tools.doctor import doctor, format_doctor, main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")
def test_doctor_on_cpu(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out
    assert "no CUDA" in out
    for name in ("transformers", "peft", "bitsandbytes", "lightning", "host RAM", "deterministic algorithms"):
        assert name in out
    report = doctor()
    assert report.ok
    assert report.get("GPU").level == "info"  # no GPU is information, not a failure
    assert report.get("pinned H2D bandwidth") is None


def test_missing_bitsandbytes_is_reported(monkeypatch):
    for name in [m for m in sys.modules if m == "bitsandbytes" or m.startswith("bitsandbytes.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    report = doctor()
    item = report.get("bitsandbytes")
    assert item.level == "error" and "pip install bitsandbytes" in item.hint
    assert not report.ok
    text = format_doctor(report)
    assert "[FAIL] bitsandbytes" in text and "HINT: pip install bitsandbytes" in text


def test_cublas_workspace_hint_on_gpu_machines(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    items = {item.name: item for item in doctor_module._determinism_items(torch, cuda=True)}
    assert items["CUBLAS_WORKSPACE_CONFIG"].level == "warn"
    assert ":4096:8" in items["CUBLAS_WORKSPACE_CONFIG"].hint
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    items = {item.name: item for item in doctor_module._determinism_items(torch, cuda=True)}
    assert items["CUBLAS_WORKSPACE_CONFIG"].level == "ok"


def test_version_requirement_violation_is_a_warning(monkeypatch):
    monkeypatch.setattr(doctor_module, "_dist_requires", lambda: ["peft>=999"])
    item = doctor_module._package_item("peft", "peft")
    assert item.level == "warn" and "peft>=999" in item.hint


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_doctor_on_gpu(capsys):
    report = doctor()
    assert report.get("GPU 0") is not None
    bandwidth = report.get("pinned H2D bandwidth")
    assert bandwidth is not None and "GB/s" in bandwidth.value
    assert main([]) in (0, 1)
    assert "GPU 0" in capsys.readouterr().out


def test_versions_keep_the_local_build_tag(monkeypatch):
    # `+cu130` vs `+cpu` tells a CUDA build of torch from a CPU one; the distribution metadata drops it.
    monkeypatch.setattr(doctor_module, "_dist_version", lambda name: "2.0.0")
    monkeypatch.setattr(doctor_module, "_dist_requires", lambda: [])
    monkeypatch.setattr(torch, "__version__", "2.0.0+cu999")
    assert doctor_module._package_item("torch", "torch").value == "2.0.0+cu999"
    monkeypatch.setattr(torch, "__version__", "2.1.0")  # not an extension of the metadata's version: keep that one
    assert doctor_module._package_item("torch", "torch").value == "2.0.0"
