"""``poros-lightning doctor``: is this machine set up for streamed QLoRA, and what to fix if not.

Invariant: the doctor only observes. It never changes global state (determinism flags, environment, RNG),
runs on CPU-only machines and without bitsandbytes, and reports each problem with a ``HINT``. The only work
it does on the GPU is a pinned host-to-device bandwidth measurement of about a second.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["DoctorItem", "DoctorReport", "doctor", "format_doctor", "main"]

Level = Literal["ok", "info", "warn", "error"]

_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
_BANDWIDTH_BYTES = 256 * 2**20
_BANDWIDTH_SECONDS = 1.0
# Below this, streaming a large model is bound by the host link rather than by compute.
_LOW_H2D_GBPS = 8.0


@dataclass(frozen=True)
class DoctorItem:
    """One observation: ``level`` is ok / info / warn / error; ``hint`` says what to do when not ok."""

    name: str
    value: str
    level: Level = "ok"
    hint: str | None = None


@dataclass
class DoctorReport:
    """Everything ``doctor`` observed, in display order."""

    items: list[DoctorItem] = field(default_factory=list)

    @property
    def problems(self) -> list[DoctorItem]:
        return [item for item in self.items if item.level in ("warn", "error")]

    @property
    def ok(self) -> bool:
        """False when something blocks the default path (an ``error`` item)."""
        return not any(item.level == "error" for item in self.items)

    def get(self, name: str) -> DoctorItem | None:
        return next((item for item in self.items if item.name == name), None)


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _requirement_problem(dist: str, installed: str) -> str | None:
    """The poros-lightning requirement ``installed`` violates, when the package metadata is available."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return None
    for line in _dist_requires():
        req = Requirement(line)
        if req.marker is None and req.name.lower() == dist.lower() and req.specifier:
            if not req.specifier.contains(installed, prereleases=True):
                return str(req)
    return None


def _dist_requires() -> list[str]:
    try:
        return importlib.metadata.requires("poros-lightning") or []
    except importlib.metadata.PackageNotFoundError:
        return []


def _full_version(module: str, version: str | None) -> str | None:
    """The module's own ``__version__`` where it extends the distribution's with a local build tag.

    ``torch.__version__`` is ``2.14.1+cu130`` or ``2.14.1+cpu`` while its metadata says ``2.14.1``: the tag tells
    a CUDA build from a CPU one, which is what a user needs to know.
    """
    own = getattr(sys.modules.get(module), "__version__", None)
    if isinstance(own, str) and version and own.startswith(version + "+"):
        return str(own)
    return version


def _package_item(dist: str, module: str, *, required: bool = True) -> DoctorItem:
    version = _dist_version(dist)
    try:
        importlib.import_module(module)
    except Exception as err:  # a broken install can raise anything at import
        hint = f"pip install -U {dist}"
        if version is None:
            return DoctorItem(dist, "not installed", "error" if required else "info", hint)
        return DoctorItem(dist, f"{version}, fails to import: {type(err).__name__}: {err}", "error", hint)
    value = _full_version(module, version) or "installed (version unknown)"
    if version:
        wanted = _requirement_problem(dist, version)
        if wanted:
            return DoctorItem(dist, f"{value} (poros-lightning needs {wanted})", "warn", f"pip install '{wanted}'")
    return DoctorItem(dist, value)


def _bitsandbytes_item(cuda: bool) -> DoctorItem:
    item = _package_item("bitsandbytes", "bitsandbytes")
    if item.level == "error":
        return DoctorItem(
            "bitsandbytes",
            item.value,
            "error",
            "pip install bitsandbytes (NF4 quantization needs it; only quantization='none' works without it)",
        )
    cext = sys.modules.get("bitsandbytes.cextension")
    backend = getattr(cext, "BNB_BACKEND", None)
    lib = getattr(cext, "lib", None)
    if lib is not None and "Mock" in type(lib).__name__:
        return DoctorItem(
            "bitsandbytes",
            f"{item.value}, native library not loaded",
            "error",
            "reinstall bitsandbytes for this platform/CUDA version (pip install --force-reinstall bitsandbytes) "
            "and run `python -m bitsandbytes` for its diagnosis",
        )
    if cuda and backend is not None and backend != "CUDA":
        return DoctorItem(
            "bitsandbytes",
            f"{item.value}, backend {backend} on a CUDA machine",
            "warn",
            "install a bitsandbytes build with CUDA kernels (pip install -U bitsandbytes)",
        )
    return DoctorItem(
        "bitsandbytes", f"{item.value}" + (f", backend {backend}" if backend else ""), item.level, item.hint
    )


def _host_ram() -> DoctorItem:
    try:
        import psutil

        mem = psutil.virtual_memory()
        total, available = mem.total, mem.available
    except ImportError:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return DoctorItem(
        "host RAM",
        f"{total / 1e9:.1f} GB total, {available / 1e9:.1f} GB available "
        "(the streamed NF4 base is pinned here: `poros-lightning check MODEL` says how much it needs)",
        "info",
    )


def _h2d_bandwidth(torch) -> DoctorItem:  # noqa: ANN001 (torch passed in to keep the import lazy)
    """Pinned host→device copy bandwidth, measured with CUDA events for about a second."""
    try:
        host = torch.empty(_BANDWIDTH_BYTES, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(_BANDWIDTH_BYTES, dtype=torch.uint8, device="cuda")
        dev.copy_(host, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        copies, t0 = 0, time.perf_counter()
        start.record()
        while time.perf_counter() - t0 < _BANDWIDTH_SECONDS:
            for _ in range(4):
                dev.copy_(host, non_blocking=True)
            copies += 4
            torch.cuda.synchronize()
        end.record()
        end.synchronize()
        gbps = copies * _BANDWIDTH_BYTES / (start.elapsed_time(end) / 1e3) / 1e9
        del host, dev
    except Exception as err:  # pinning can fail under memlock limits or in containers
        return DoctorItem(
            "pinned H2D bandwidth",
            f"measurement failed: {type(err).__name__}: {err}",
            "warn",
            "pinned host memory may be restricted (containers, ulimit -l); streaming needs pinned memory",
        )
    value = f"{gbps:.1f} GB/s (pinned, {_BANDWIDTH_BYTES >> 20} MiB copies)"
    if gbps < _LOW_H2D_GBPS:
        return DoctorItem(
            "pinned H2D bandwidth",
            value,
            "warn",
            "low for streaming: check that the GPU sits in a full x16 PCIe slot and that the process runs on the "
            "CPU socket (NUMA node) closest to the GPU (numactl --cpunodebind)",
        )
    return DoctorItem("pinned H2D bandwidth", value)


def _cuda_items(torch) -> tuple[list[DoctorItem], bool]:  # noqa: ANN001
    items = [DoctorItem("CUDA (torch build)", torch.version.cuda or "none (CPU build of torch)", "info")]
    if not torch.cuda.is_available():
        hint = None
        if torch.version.cuda is None and sys.platform.startswith("linux"):
            hint = "for GPU training install a CUDA build of torch (https://pytorch.org/get-started/locally/)"
        items.append(
            DoctorItem(
                "GPU",
                "no CUDA device: CPU-only (fine for tests and CPU parity runs; streamed training needs a CUDA GPU)",
                "info",
                hint,
            )
        )
        return items, False
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        items.append(
            DoctorItem(
                f"GPU {index}",
                f"{props.name}, {props.total_memory / 1e9:.1f} GB, compute capability {props.major}.{props.minor}",
            )
        )
    if not torch.cuda.is_bf16_supported():
        items.append(
            DoctorItem(
                "bf16", "not supported by GPU 0", "warn", "use a GPU with bf16 (Ampere or newer) for bf16 compute"
            )
        )
    items.append(_h2d_bandwidth(torch))
    return items, True


def _determinism_items(torch, cuda: bool) -> list[DoctorItem]:  # noqa: ANN001
    enabled = torch.are_deterministic_algorithms_enabled()
    items = [
        DoctorItem(
            "deterministic algorithms",
            f"{'on' if enabled else 'off'} in this process (PorosStrategy and the parity gates switch them on)",
            "info",
        )
    ]
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if cublas in _DETERMINISTIC_CUBLAS:
        items.append(DoctorItem("CUBLAS_WORKSPACE_CONFIG", cublas))
    elif cuda:
        items.append(
            DoctorItem(
                "CUBLAS_WORKSPACE_CONFIG",
                repr(cublas) if cublas else "not set",
                "warn",
                "export CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting Python: deterministic cuBLAS needs it, and "
                "bit-identical streamed vs resident runs need deterministic kernels",
            )
        )
    else:
        items.append(
            DoctorItem("CUBLAS_WORKSPACE_CONFIG", f"{cublas or 'not set'} (only read by cuBLAS on a GPU)", "info")
        )
    return items


def doctor() -> DoctorReport:
    """Inspect the environment: versions, GPU, pinned bandwidth, host RAM, determinism settings."""
    report = DoctorReport()
    add = report.items.append
    add(DoctorItem("python", f"{platform.python_version()} ({sys.executable})", "info"))
    add(
        DoctorItem(
            "poros-lightning", _dist_version("poros-lightning") or "not installed (running from a source tree)", "info"
        )
    )
    torch_item = _package_item("torch", "torch")
    add(torch_item)
    if torch_item.level == "error":
        add(_package_item("transformers", "transformers"))
        add(_package_item("peft", "peft"))
        add(_package_item("lightning", "lightning"))
        add(_host_ram())
        return report
    import torch

    cuda_items, cuda = _cuda_items(torch)
    report.items.extend(cuda_items)
    add(_package_item("transformers", "transformers"))
    add(_package_item("peft", "peft"))
    add(_package_item("lightning", "lightning"))
    add(_bitsandbytes_item(cuda))
    add(_host_ram())
    report.items.extend(_determinism_items(torch, cuda))
    return report


_TAGS = {"ok": "[ ok ]", "info": "[info]", "warn": "[warn]", "error": "[FAIL]"}


def format_doctor(report: DoctorReport) -> str:
    """Plain-text report: one line per item, a ``HINT`` under each problem, and a summary."""
    width = max(len(item.name) for item in report.items)
    lines = []
    for item in report.items:
        lines.append(f"{_TAGS[item.level]} {item.name:<{width}}  {item.value}")
        if item.hint and item.level != "ok":
            lines.append(f"       {'':<{width}}  HINT: {item.hint}")
    problems = report.problems
    if problems:
        lines.append(f"\n{len(problems)} problem(s): {', '.join(item.name for item in problems)}.")
    else:
        lines.append("\nno problems found.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``poros-lightning doctor``; returns 0 unless something blocks the default path (then 1)."""
    argparse.ArgumentParser(
        prog="poros-lightning doctor",
        description="Check versions, GPU, pinned host-to-device bandwidth, host RAM and determinism settings.",
    ).parse_args(argv)
    report = doctor()
    print(format_doctor(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
