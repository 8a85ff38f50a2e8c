"""How far can the host run ahead of the GPU? The bound behind a copy-bound streamed forward.

A streamed step whose forward waits on copies (72B at minimum memory) could still hide that wait if the
host went on issuing the backward while the GPU finished the forward. The host can only run ahead as
far as the queue of pending launches allows: once it is full, each launch waits for the GPU to retire
one. This probe parks the compute stream behind a long sleep kernel, then launches tiny kernels one by
one and times each launch on the host; the first launch that takes milliseconds marks the depth::

    python -m poros_lightning.tools.bench.launch_probe --out docs/benchmarks/launch_queue.jsonl

The row holds the depth (kernels the host can queue ahead) and the host's cost per launch, for the
torch and driver it ran under.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

__all__ = ["probe"]


def probe(max_kernels: int = 20000, blocked_s: float = 1e-3, sleep_s: float = 2.0) -> dict[str, Any]:
    """Queue depth of kernel launches behind a busy GPU, and the host's time per launch.

    Args:
        max_kernels: stop after this many launches (the depth is reported as ``None`` if none blocked).
        blocked_s: a launch that takes longer than this on the host waited for the GPU.
        sleep_s: how long the GPU stays busy before the tiny kernels (long enough for ``max_kernels``).
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("launch_probe needs a CUDA device.")
    x = torch.zeros(1, device="cuda")
    for _ in range(100):  # warm the kernel and the allocator
        x.add_(1)
    torch.cuda.synchronize()
    # Cycles per second, from a short timed sleep.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles_per_s = 10_000_000 / (start.elapsed_time(end) / 1e3)
    torch.cuda._sleep(int(sleep_s * cycles_per_s))
    depth = None
    launch_times = []
    for i in range(max_kernels):
        t = time.perf_counter()
        x.add_(1)
        dt = time.perf_counter() - t
        if dt > blocked_s:
            depth = i
            break
        launch_times.append(dt)
    torch.cuda.synchronize()
    launch_times.sort()
    return {
        "probe": "launch_queue",
        "queue_depth_kernels": depth,
        "launch_us_median": launch_times[len(launch_times) // 2] * 1e6,
        "blocked_s": blocked_s,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": _driver(),
    }


def _driver() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m poros_lightning.tools.bench.launch_probe", description=__doc__)
    p.add_argument("--out", help="JSONL file to append the row to")
    args = p.parse_args(argv)
    row = probe()
    print(row)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
