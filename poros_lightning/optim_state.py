"""Optimizer state in host memory between steps: the device holds it only while the optimizer steps.

Invariant: the update runs on the device, with the same kernels on the same bytes as a resident
optimizer; only where the state waits between steps changes (exact copies both ways).

Note: [when the state moves]
    Lightning evaluates the training closure (forward and backward) inside ``optimizer.step``. The
    state comes onto the device after the closure has run, right before the update, and goes back to
    host memory after it, so the forward and backward peaks never include it. Tensors shaped like their
    parameter move (AdamW's ``exp_avg`` and ``exp_avg_sq``); scalars such as ``step`` stay where the
    optimizer keeps them.
"""

from __future__ import annotations

import torch

__all__ = ["HostOptimizerState"]


class HostOptimizerState:
    """Moves the per-parameter state tensors of ``optimizer`` between host buffers and the device.

    Args:
        optimizer: a torch optimizer whose parameters live on one device.
        pin_memory: page-lock the host buffers when the parameters are on CUDA (faster, asynchronous copies).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, pin_memory: bool = True) -> None:
        self.optimizer = optimizer
        self.pin_memory = pin_memory
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}

    def _moving(self) -> list[tuple[torch.Tensor, dict, str, torch.Tensor]]:
        found = []
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0:
                    found.append((param, state, key, value))
        return found

    @torch.no_grad()
    def to_host(self) -> int:
        """Copy the state into the host buffers (allocated on first use) and keep those; returns bytes moved."""
        moved, devices = 0, set()
        for param, state, key, value in self._moving():
            buf = self.buffers.get((id(param), key))
            if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                pin = self.pin_memory and value.device.type == "cuda"
                buf = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
                self.buffers[(id(param), key)] = buf
            if buf is not value:
                # Asynchronous into pinned memory; freeing ``value`` right after is stream-ordered, so safe.
                buf.copy_(value, non_blocking=buf.is_pinned())
                if value.device.type == "cuda":
                    devices.add(value.device)
                state[key] = buf
            moved += buf.numel() * buf.element_size()
        for device in devices:  # the host bytes are complete when this returns (checkpoints read them)
            torch.cuda.synchronize(device)
        return moved

    @torch.no_grad()
    def to_device(self) -> None:
        """Put each state tensor back on its parameter's device (a no-op for parameters on the CPU)."""
        for param, state, key, value in self._moving():
            if value.device != param.device:
                state[key] = value.to(param.device, non_blocking=True)
