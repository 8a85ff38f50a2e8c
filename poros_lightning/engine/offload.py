"""The inputs a recomputed layer saves, in pinned host memory from the layer's forward to its backward.

Invariant: the recompute reads the same bytes it would have read on the device; only where they wait
changes. A device tensor the forward packed is not read or written again by the offload after its copy
out, and the copy back completes before the compute stream reads it.

Note: [what is offloaded]
    Non-reentrant checkpointing saves each recomputed layer's tensor arguments (the hidden state the
    recompute starts from) through the saved-tensor hooks active around the ``checkpoint`` call; the
    layer's own activations go to checkpoint's inner hooks, which take precedence, and are not seen here.
    So hooks installed around a streamed layer's ``checkpoint`` call see exactly its inputs: one hidden
    state per layer and micro-batch (``tokens x hidden`` bf16; 0.67 GB over Qwen2.5-72B's 80 layers at
    seq 512), the largest thing a streamed forward accumulates. Tensors below ``min_bytes`` (position
    tables, masks shared by every layer) stay where they are.

Note: [the two copies]
    The copy out runs on a stream of its own, ordered after the kernel that wrote the tensor;
    ``record_stream`` keeps the device memory from being reused before the copy has read it. Device-to-host
    copies use the link's other direction, which a streamed forward leaves idle. The copy back is queued on
    the slot ring's copy stream when the backward reaches the next layer up (one layer ahead), behind that
    layer's block reload, in the backward's otherwise idle link time. A tensor nobody prefetched (the last
    layer's input) is copied back on the compute stream when the recompute asks for it. Each copy back
    gives a new device tensor, so a second backward through the same graph (``retain_graph``) works too.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["InputOffload"]


class _Offloaded:
    """One packed tensor: its host copy, the event that marks the copy out, and a prefetched copy back."""

    __slots__ = ("host", "written", "device", "fetched", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, written: torch.cuda.Event | None, device: torch.device) -> None:
        self.host = host
        self.written = written
        self.device = device
        self.fetched: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None


class InputOffload:
    """Saved-tensor hooks that keep recomputed layers' inputs in (pinned) host memory.

    Args:
        device: the compute device.
        copy_stream: the stream the copies back run on (the slot ring's); ``None`` copies synchronously.
        min_bytes: tensors smaller than this stay on the device.
    """

    def __init__(self, device: torch.device, copy_stream: torch.cuda.Stream | None, min_bytes: int = 1 << 20) -> None:
        self.device = device
        self.copy_stream = copy_stream if device.type == "cuda" else None
        self.out_stream = torch.cuda.Stream(device) if self.copy_stream is not None else None
        self.min_bytes = min_bytes
        self.packed = 0  # tensors offloaded; tests and benchmarks read it
        self._by_layer: dict[int, list[weakref.ref[_Offloaded]]] = {}  # live packs, for the prefetch

    def pack(self, index: int, tensor: torch.Tensor) -> Any:
        """Saved-tensor pack hook of layer ``index``: a large device tensor leaves for host memory."""
        if tensor.device != self.device or tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        if self.out_stream is not None:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.out_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.out_stream):
                host.copy_(tensor, non_blocking=True)
                written = torch.cuda.Event()
                written.record(self.out_stream)
            tensor.record_stream(self.out_stream)  # Note: [the two copies]
        else:
            host, written = tensor.detach().to("cpu", copy=True), None
        record = _Offloaded(host, written, self.device)
        live = [r for r in self._by_layer.get(index, []) if r() is not None]
        live.append(weakref.ref(record))
        self._by_layer[index] = live
        self.packed += 1
        return record

    @torch.no_grad()
    def prefetch(self, index: int) -> None:
        """Queue the copy back of layer ``index``'s packed inputs on the copy stream."""
        if self.copy_stream is None:
            return
        for ref in self._by_layer.get(index, []):
            record = ref()
            if record is None or record.fetched is not None:
                continue
            dev = torch.empty(record.host.shape, dtype=record.host.dtype, device=self.device)
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the memory's last user
            with torch.cuda.stream(self.copy_stream):
                if record.written is not None:
                    self.copy_stream.wait_event(record.written)
                dev.copy_(record.host, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            dev.record_stream(self.copy_stream)  # freed unused, it is not reused mid-copy
            record.fetched, record.ready = dev, ready

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the device tensor again (prefetched, or copied back now)."""
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.fetched is not None:
            dev, packed.fetched = packed.fetched, None
            torch.cuda.current_stream(self.device).wait_event(packed.ready)
            return dev
        if self.copy_stream is not None:
            stream = torch.cuda.current_stream(self.device)
            if packed.written is not None:
                stream.wait_event(packed.written)
            return packed.host.to(self.device, non_blocking=True)
        return packed.host.to(self.device, copy=True)
