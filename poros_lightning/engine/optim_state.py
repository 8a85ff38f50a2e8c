"""Optimizer state in host memory between steps: the device holds it only around the update.

Invariant: the update runs on the device, with the same kernels on the same bytes as a resident
optimizer; only where the state waits between steps changes (exact copies both ways).

Note: [when the state moves]
    Lightning evaluates the training closure (forward and backward) inside ``optimizer.step``. Tensors
    shaped like their parameter move (AdamW's ``exp_avg`` and ``exp_avg_sq``); scalars such as ``step``
    stay where the optimizer keeps them. Both copies run on side streams, so neither stalls the compute
    stream nor the host:

    - **In, during the backward.** :meth:`HostOptimizerState.arm` (called before the closure of a step
      that will update) makes the backward start the copies in when the gradient of one trigger parameter
      has been accumulated: the one a quarter of the way into the optimizer's parameter order, so in a
      decoder (layer 0 first) the last quarter of the backward hides them. The forward's peak never
      includes the moments; the backward's last quarter does (the gradients are mostly there by then, so
      this part of the step has the moments, the adapter and the gradients, as the update itself does).
      :meth:`to_device` makes the compute stream wait for the copies (an event; no host wait), or copies
      on the compute stream when nothing was prefetched (the trigger's gradient never came, or
      ``prefetch_at=None``).
      Under block-major micro-batches the strategy passes ``prefetch_at=None``: there the backward's last
      quarter also holds every micro-batch's boundary gradients and the per-micro-batch LoRA gradients that
      wait for their ordered sum, and the moments beside them made that part of the step the peak. At
      Qwen2.5-32B and 72B, 16 micro-batches x 512 tokens, the minimum plans peaked 0.31 and 0.41 GB above
      their estimates there (docs/benchmarks/recipes.jsonl, runs ``2026-12-06T19:45:30`` and ``20:21:41``:
      ``peak_forward_backward_gb`` above the first, unprefetched step's ``tuned`` peak). Copied after the
      backward instead, the moments wait on the link once per step (1.1 GB at 32B, some 20 ms at 55 GB/s)
      in a step k times as long as one micro-batch's.
    - **Out, after the update.** :meth:`to_host` queues the copy into pinned host memory on a second
      side stream (the other copy direction: it overlaps the next forward's block copies), marks the
      device memory as used there so the allocator does not reuse it mid-copy, and points the state at
      the host memory at once.

    The state of all parameters on one device with one dtype lives in one flat buffer (on the host, and
    on the device while it is there), each tensor a view into it, so each move is one copy and one call
    that makes the views: moved tensor by tensor, a 72B adapter's 2240 moments cost the host more time
    to issue than the link to carry them. The optimizer updates the views in place (AdamW does); when
    the state is not the views this class put there (the optimizer replaced a tensor, ``load_state_dict``,
    new parameters), the tensors move one by one and the next copy out makes a new layout.

Note: [reading the state between steps]
    The host buffers are complete only when the copy out has finished. ``optimizer.state_dict()`` and
    ``optimizer.load_state_dict()`` wait for it (pre-hooks), as does ``torch.cuda.synchronize()``; code
    that reads ``optimizer.state`` directly between steps calls :meth:`HostOptimizerState.synchronize`
    first. The next copy in waits for the copy out on the GPU (an event), never on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch._utils import _unflatten_dense_tensors

__all__ = ["HostOptimizerState"]

_Key = tuple[int, str]  # (id(param), state key)
_Group = tuple[torch.device, torch.dtype]


def _empty_on(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialized device memory for ``value``'s copy in (the GPU tests' control fills it with NaN)."""
    return torch.empty_like(value, device=device)


@dataclass
class _Flat:
    """The moving state tensors of one (device, dtype): where each sits, and its view of a flat host buffer."""

    slots: list[tuple[dict, str]]  # (the parameter's state dict, the key) of each tensor, in buffer order
    host: torch.Tensor
    host_views: tuple[torch.Tensor, ...]

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _unflatten_dense_tensors(flat, self.host_views)  # one call, the views in C++

    def holds(self, views: tuple[torch.Tensor, ...]) -> bool:
        """Whether the state is exactly ``views`` (nothing replaced, added or removed since)."""
        return all(state.get(name) is v for (state, name), v in zip(self.slots, views, strict=True))

    def point(self, views: tuple[torch.Tensor, ...]) -> None:
        for (state, name), v in zip(self.slots, views, strict=True):
            state[name] = v


class HostOptimizerState:
    """Moves the per-parameter state tensors of ``optimizer`` between host memory and the device.

    Args:
        optimizer: a torch optimizer.
        pin_memory: page-lock the host buffers when the parameters are on CUDA (faster, asynchronous copies).
        prefetch_at: where in the optimizer's parameter order the trigger parameter sits (0: the first);
            when its gradient is accumulated in an armed backward, the copies in start (Note: [when the
            state moves]). ``None``: no prefetch, the copies in run at :meth:`to_device`.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, pin_memory: bool = True, prefetch_at: float | None = 0.25
    ) -> None:
        self.optimizer = optimizer
        self.pin_memory = pin_memory
        self.buffers: dict[_Key, torch.Tensor] = {}  # the host view each state tensor waits in
        self.prefetches = 0  # copies in started by the backward's trigger; tests and benchmarks read it
        self.fault: str | None = None  # "no_wait": negative control for the GPU tests only
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        self._flats: dict[_Group, _Flat] = {}
        self._params = -1  # len(optimizer.state) when the layouts were made
        self._staged: dict[_Group, tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.cuda.Event]] = {}
        self._on_device: dict[_Group, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}  # views, flat
        self._written: dict[torch.device, torch.cuda.Event] = {}  # the last copy out, per device
        self._armed = False
        self._trigger: Any = None
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if prefetch_at is not None and params and hasattr(params[0], "register_post_accumulate_grad_hook"):
            trigger = params[min(len(params) - 1, int(len(params) * prefetch_at))]
            self._trigger = trigger.register_post_accumulate_grad_hook(self._on_trigger)
        optimizer.register_state_dict_pre_hook(lambda _opt: self.synchronize())
        optimizer.register_load_state_dict_pre_hook(lambda _opt, _sd: self._forget())

    def _groups(self) -> dict[_Group, list[tuple[_Key, dict, str, torch.Tensor]]]:
        """Each moving state tensor (shaped like its parameter), grouped by its parameter's device and dtype."""
        found: dict[_Group, list[tuple[_Key, dict, str, torch.Tensor]]] = {}
        for param, state in self.optimizer.state.items():
            for name, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0:
                    found.setdefault((param.device, value.dtype), []).append(((id(param), name), state, name, value))
        return found

    def _laid_out(self) -> bool:
        """Whether the layouts still cover the optimizer's parameters (none added or dropped)."""
        return bool(self._flats) and len(self.optimizer.state) == self._params

    def _stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        """The side stream of ``direction`` (``"in"`` or ``"out"``) on ``device``."""
        stream = self._streams.get((device, direction))
        if stream is None:
            stream = self._streams[(device, direction)] = torch.cuda.Stream(device)
        return stream

    def _wait_written(self, stream: torch.cuda.Stream, device: torch.device) -> None:
        written = self._written.get(device)
        if written is not None and self.fault != "no_wait":
            stream.wait_event(written)

    def arm(self) -> None:
        """Let the next backward start the copies in (call before the closure of a step that updates)."""
        self._armed = True

    def _on_trigger(self, _param: torch.Tensor) -> None:
        if self._armed:
            self._armed = False
            if self.prefetch():
                self.prefetches += 1

    @torch.no_grad()
    def prefetch(self) -> bool:
        """Start copying the state that waits in host memory to the device on a side stream; True if any was."""
        if not self._laid_out():
            return False
        queued = False
        for group, flat in self._flats.items():
            device = group[0]
            if device.type != "cuda" or group in self._staged or not flat.holds(flat.host_views):
                continue
            stream = self._stream(device, "in")
            # The memory allocated below had users on the compute stream; the host buffer, a writer.
            stream.wait_stream(torch.cuda.current_stream(device))
            self._wait_written(stream, device)
            dev = _empty_on(flat.host, device)  # in the compute stream's order (its only user after)
            with torch.cuda.stream(stream):
                dev.copy_(flat.host, non_blocking=flat.host.is_pinned())
            dev.record_stream(stream)  # dropped unused (load_state_dict), it is not reused mid-copy
            ready = torch.cuda.Event()
            ready.record(stream)
            self._staged[group] = (flat.views(dev), dev, ready)
            queued = True
        return queued

    @torch.no_grad()
    def to_device(self) -> None:
        """Put each state tensor on its parameter's device: the prefetched copy (the compute stream waits for
        it), or a copy queued now on the compute stream."""
        staged, self._staged = self._staged, {}
        moved: set[_Group] = set()
        if self._laid_out():
            for group, flat in self._flats.items():
                device = group[0]
                if device.type != "cuda" or not flat.holds(flat.host_views):
                    continue
                current = torch.cuda.current_stream(device)
                if group in staged:
                    views, dev, ready = staged[group]
                    if self.fault != "no_wait":
                        current.wait_event(ready)
                else:
                    self._wait_written(current, device)
                    dev = flat.host.to(device, non_blocking=True)
                    views = flat.views(dev)
                flat.point(views)
                self._on_device[group] = (views, dev)
                moved.add(group)
        if self._laid_out() and all(g in moved or g[0].type != "cuda" for g in self._flats):
            return
        for group, entries in self._groups().items():  # what the layouts do not hold: one by one
            device = group[0]
            if group in moved or device.type != "cuda":
                continue
            self._wait_written(torch.cuda.current_stream(device), device)
            for _k, state, name, value in entries:
                if value.device != device:
                    state[name] = value.to(device, non_blocking=True)
            self._on_device.pop(group, None)

    def _layout(self, group: _Group, entries: list[tuple[_Key, dict, str, torch.Tensor]]) -> _Flat:
        """The group's host layout, new when its tensors changed (their set, order or shapes)."""
        flat = self._flats.get(group)
        same = flat is not None and len(flat.slots) == len(entries)
        if same:
            same = all(
                slot[0] is state and slot[1] == name and v.shape == value.shape
                for slot, v, (_k, state, name, value) in zip(flat.slots, flat.host_views, entries, strict=True)
            )
        if not same:
            pin = self.pin_memory and group[0].type == "cuda"
            host = torch.empty(sum(value.numel() for *_, value in entries), dtype=group[1], pin_memory=pin)
            views = _unflatten_dense_tensors(host, [value for *_, value in entries])
            flat = self._flats[group] = _Flat([(state, name) for _k, state, name, _v in entries], host, views)
            for (key, *_), view in zip(entries, flat.host_views, strict=True):
                self.buffers[key] = view
        return flat

    def _copy_out(self, device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (device tensor, host tensor) pair on the side stream; the device memory is freed after."""
        if device.type == "cuda" and all(host.is_pinned() for _d, host in pairs):
            stream = self._stream(device, "out")
            stream.wait_stream(torch.cuda.current_stream(device))  # after the update
            with torch.cuda.stream(stream):
                for dev, host in pairs:
                    host.copy_(dev, non_blocking=True)
            for dev, _host in pairs:
                dev.record_stream(stream)  # freed by the caller; not reused before the copy has read it
            event = torch.cuda.Event()
            event.record(stream)
            self._written[device] = event
        else:
            for dev, host in pairs:
                if dev is not host:
                    host.copy_(dev)

    @torch.no_grad()
    def to_host(self) -> int:
        """Queue the copies into host memory and point the state at it; returns the bytes moved.

        The host bytes are complete once :meth:`synchronize` returns.
        """
        moved, done = 0, set()
        if self._laid_out():
            for group, flat in self._flats.items():
                views, dev = self._on_device.get(group, ((), None))
                if dev is not None and flat.holds(views):
                    self._copy_out(group[0], [(dev, flat.host)])
                    flat.point(flat.host_views)
                elif not flat.holds(flat.host_views):
                    continue
                self._on_device.pop(group, None)
                moved += flat.host.numel() * flat.host.element_size()
                done.add(group)
            if len(done) == len(self._flats):
                return moved
        groups = self._groups()  # a new or changed set of tensors: a new layout, filled one by one
        for group, entries in groups.items():
            if group in done:
                continue
            flat = self._layout(group, entries)
            self._on_device.pop(group, None)
            self._copy_out(
                group[0], [(value, view) for (*_, value), view in zip(entries, flat.host_views, strict=True)]
            )
            flat.point(flat.host_views)
            moved += flat.host.numel() * flat.host.element_size()
        for group in [g for g in self._flats if g not in groups]:
            del self._flats[group]
        self._params = len(self.optimizer.state)
        return moved

    def synchronize(self) -> None:
        """Wait until the host buffers hold the last update's state (Note: [reading the state between steps])."""
        for event in self._written.values():
            event.synchronize()

    def _forget(self) -> None:
        """Before the state is replaced: finish the copies out, drop what was prefetched and the layouts (they
        point into the state dicts about to be replaced)."""
        self.synchronize()
        self._staged.clear()
        self._on_device.clear()
        self._flats.clear()
        self._params = -1
        self._armed = False

    def close(self) -> None:
        """Finish the copies out and remove the trigger hook (the state stays where it is)."""
        self._forget()
        if self._trigger is not None:
            self._trigger.remove()
            self._trigger = None
