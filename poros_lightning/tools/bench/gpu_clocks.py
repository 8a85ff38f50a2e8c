"""The GPU's clocks during a method's timed steps, sampled by ``nvidia-smi``: whether a slow step ran a slow card.

Note: [clocks]
    Two plans of one run can differ by less than one plan's steps differ among themselves: at Qwen2.5-72B, seq 512
    (H100), one plan's tuning step took 1.594 s and its timed steps 1.901 s on average, none under 1.730 s;
    ``resident_gc``, which copies nothing, took 1.294 s at its fastest and 1.482 s on average (docs/planner.md). A step that ran at a lower SM clock (a power cap, a thermal slowdown,
    another tenant's load on the board) is slower for the card's reasons, not the plan's. So while the timed
    steps run, ``nvidia-smi`` samples the SM clock, the board's power and temperature and the reasons the driver
    gives for holding the clocks down, every ``period_ms``, in its own process (no work on the step's host
    thread); the row gets their summary (``gpu_clocks``). Where ``nvidia-smi`` is missing or reports nothing,
    the row says so (``None``) and the run goes on.
"""

from __future__ import annotations

import subprocess
import tempfile
from typing import IO, Any

__all__ = ["REASONS", "ClockSampler", "summarize"]

QUERY = "uuid,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"

REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
"""The driver's clock-event reasons, by bit of ``clocks_throttle_reasons.active`` (NVML's names)."""


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def summarize(lines: list[str], uuid: str | None = None) -> dict[str, Any] | None:
    """Summary of ``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`` lines of the GPU ``uuid`` (any
    GPU's where ``None``): SM clock min/mean/max (MHz), the largest power draw (W) and temperature (C), and for
    each clock-event reason the share of samples it was active in; ``None`` where no line is the GPU's."""
    want = uuid.removeprefix("GPU-").lower() if uuid else None
    clocks, power, temp, reasons = [], [], [], []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 5 or (want is not None and fields[0].removeprefix("GPU-").lower() != want):
            continue
        sm, watts, celsius = (_number(f) for f in fields[1:4])
        if sm is None:
            continue
        clocks.append(sm)
        power += [watts] if watts is not None else []
        temp += [celsius] if celsius is not None else []
        try:
            reasons.append(int(fields[4], 16))
        except ValueError:
            pass
    if not clocks:
        return None
    seen = (
        {name: sum(bool(r & bit) for r in reasons) / len(reasons) for bit, name in REASONS.items()} if reasons else {}
    )
    return {
        "samples": len(clocks),
        "sm_mhz_min": min(clocks),
        "sm_mhz_mean": round(sum(clocks) / len(clocks), 1),
        "sm_mhz_max": max(clocks),
        "power_w_max": max(power) if power else None,
        "temp_c_max": max(temp) if temp else None,
        "reasons": {name: round(share, 3) for name, share in seen.items() if share},
    }


class ClockSampler:
    """Samples the GPU ``uuid``'s clocks with ``nvidia-smi`` between :meth:`start` and :meth:`stop` (Note: [clocks]).

    Args:
        uuid: the GPU's UUID (``torch.cuda.get_device_properties(i).uuid``); ``None``: every GPU's samples.
        period_ms: sampling period.
        command: the ``nvidia-smi`` executable.
    """

    def __init__(self, uuid: str | None = None, period_ms: int = 100, command: str = "nvidia-smi") -> None:
        self.uuid, self.period_ms, self.command = uuid, period_ms, command
        self._proc: subprocess.Popen[str] | None = None
        self._out: IO[str] | None = None

    @classmethod
    def of_device(cls, index: int) -> ClockSampler:
        """A sampler of the CUDA device ``index`` (by its UUID, where torch gives one)."""
        import torch

        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        return cls(str(uuid) if uuid is not None else None)

    def start(self) -> None:
        """Start sampling (a no-op where ``nvidia-smi`` cannot start)."""
        self.close()
        self._out = tempfile.TemporaryFile("w+")  # a file, not a pipe: a long run's samples never block the sampler
        args = [self.command, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"--loop-ms={self.period_ms}"]
        try:
            self._proc = subprocess.Popen(args, stdout=self._out, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.close()

    def stop(self) -> dict[str, Any] | None:
        """Stop sampling; the summary of the samples (:func:`summarize`), ``None`` where there are none."""
        if self._proc is None or self._out is None:
            self.close()
            return None
        self._stop_process()
        self._out.seek(0)
        lines = self._out.read().splitlines()
        self.close()
        return summarize(lines, self.uuid)

    def _stop_process(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def close(self) -> None:
        """Stop the sampler, if running, and drop its samples."""
        self._stop_process()
        if self._out is not None:
            self._out.close()
            self._out = None
