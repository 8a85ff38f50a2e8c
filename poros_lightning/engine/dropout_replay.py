"""Dropout draws in block-major order, placed where layer-major accumulation makes them (CUDA's Philox offsets).

Invariant: every (micro-batch ``i``, decoder layer ``j``) of a block-major forward, and of its recompute, starts
with the generator offset at which layer-major accumulation (one micro-batch after the other) starts it, and the
forward leaves the offset where layer-major accumulation leaves it.

Note: [dropout in block-major order]
    Block-major order draws random numbers in another order (micro-batch 2 of layer 1 draws before
    micro-batch 1 of layer 2). On CUDA the generator is a Philox counter: a draw depends on the seed and
    the generator's offset, and each dropout launch moves the offset by an amount fixed by its shape. So
    each (micro-batch ``i``, layer ``j``) is given the offset at which layer-major accumulation starts it:
    ``O + sum(D of micro-batches before i) + sum(d of layers before j in micro-batch i)``, where ``O`` is
    the offset when the body (the decoder stack) is called, ``d`` a layer's advance for one micro-batch of
    that shape and ``D`` the sum over layers. ``d`` is measured once per micro-batch shape by a probe: the
    body runs that micro-batch alone under ``no_grad`` (the same kernels draw the same amounts) and the
    offset is read around every layer; then the offset is put back. Every chunk's advance in the real
    forward is checked against the probe's (a mismatch raises before the optimizer step), the body's end
    leaves the offset where layer-major accumulation leaves it (checked). A streamed layer checkpoints each
    micro-batch on its own (Note: [one checkpoint per micro-batch] in engine.microbatch) after its offset is set,
    and the checkpoint records the generator's state and restores it for the recompute; where the recompute runs
    through the splitter instead (a layer checkpointed around all its micro-batches), it sets the same offsets
    again and restores the generator afterwards. Draws outside the decoder layers
    (an embedding dropout) run once for the whole batch in block-major order and cannot be replayed: the
    probe refuses them, and the end of the backward checks that nothing after the stack (the head, the loss) drew
    any. A short last batch has micro-batches of another shape: they get their own probe,
    so such a step stays exact too (no fall-back to sample-major order is needed). On the CPU the
    generator has no offset: :func:`~poros_lightning.api.check_block_major` refuses dropout there.

Note: [one forward, one backward]
    The recompute of a layer in the backward takes its offsets from the layout of the forward it belongs to,
    which is the last body forward until that backward ends (:meth:`DropoutReplay.finish`, called where the
    micro-batches' gradients are summed). A second forward that records gradients before that backward would
    replace it, so it is refused. Each probe is one extra streamed pass of one micro-batch, once per
    micro-batch shape (pad to one length, as block-major needs anyway).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from poros_lightning.errors import PorosConfigError, PorosError

__all__ = ["DropoutReplay", "cuda_generator"]

_EXACT_INSTEAD = "Use micro_batches=1 with Trainer(accumulate_grad_batches=k), which is exact, or set the dropout to 0."


def cuda_generator(device: torch.device) -> torch.Generator:
    """The default CUDA generator of ``device`` (the one dropout draws from)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def _in_backward() -> bool:
    """True inside the autograd engine (a checkpoint's recompute runs there)."""
    return torch._C._current_graph_task_id() != -1


class _Layout:
    """One body call's offsets: ``starts[i][j]`` where (micro-batch ``i``, layer ``j``) starts, ``advances[i][j]``
    how far it moves the offset, ``end`` where the body leaves it; ``ran`` the layers its forward has run."""

    def __init__(self, generator: Any, starts: list[list[int]], advances: list[list[int]], end: int) -> None:
        self.generator, self.starts, self.advances, self.end = generator, starts, advances, end
        self.ran: set[int] = set()
        self.open = True  # the body's forward is running: its layers may take their offsets


class DropoutReplay:
    """Places the dropout draws of block-major micro-batches (Note: [dropout in block-major order]).

    Args:
        rng: the generator dropout draws from, for a device (:func:`cuda_generator`); anything with
            ``get_offset``/``set_offset``.
        layers: the decoder layers, in execution order.
        sizes: rows of each micro-batch of a batch of ``rows`` rows (``MicroBatches.sizes``).
    """

    def __init__(self, rng: Callable[[torch.device], Any], layers: list[nn.Module], sizes: Callable[[int], list[int]]):
        self.rng, self.sizes = rng, sizes
        self.layer_index = {id(m): j for j, m in enumerate(layers)}
        self.advances: dict[tuple[Any, ...], list[int]] = {}  # per micro-batch shape: each layer's offset advance
        self.probes = 0  # probe forwards run (one per micro-batch shape)
        self.current: _Layout | None = None
        self._probe: list[tuple[int, int, int]] | None = None  # (layer, offset before, offset after) in a probe
        self._probe_generator: Any = None

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def probed(self, module: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``module``'s forward inside a probe: records the offset around a decoder layer."""
        layer = self.layer_index.get(id(module))
        if layer is None or self._probe is None:
            return original(*args, **kwargs)
        before = self._probe_generator.get_offset()
        out = original(*args, **kwargs)
        self._probe.append((layer, before, self._probe_generator.get_offset()))
        return out

    @contextlib.contextmanager
    def chunks(self, module: nn.Module, n: int) -> Iterator[Callable[[int], contextlib.AbstractContextManager] | None]:
        """Around the ``n`` micro-batches of ``module``: yields ``place(i)``, a context that runs micro-batch ``i`` at
        its offset and checks its advance (``None`` for a module that is not a decoder layer)."""
        layer = self.layer_index.get(id(module))
        if layer is None:
            yield None
            return
        backward = _in_backward()
        layout = self.current
        if layout is None or len(layout.starts) != n or (not backward and (layer in layout.ran or not layout.open)):
            raise PorosError(
                f"Decoder layer {layer} ran outside a forward of the model's decoder stack, so the offsets of its "
                "dropout draws in block-major order are not known.",
                "Call the model (or its decoder stack) rather than its layers, or use micro_batches=1 "
                "(Trainer(accumulate_grad_batches=k) is exact).",
            )
        if not backward:
            layout.ran.add(layer)
        generator = layout.generator
        restore = generator.get_offset() if backward else None

        @contextlib.contextmanager
        def place(i: int) -> Iterator[None]:
            generator.set_offset(layout.starts[i][layer])
            yield
            if not backward:
                self._check_advance(layout, i, layer)

        try:
            yield place
        finally:
            if restore is not None:  # a recompute leaves the generator as it found it
                generator.set_offset(restore)

    @staticmethod
    def _check_advance(layout: _Layout, i: int, layer: int) -> None:
        expected = layout.starts[i][layer] + layout.advances[i][layer]
        got = layout.generator.get_offset()
        if got != expected:
            raise PorosError(
                f"Micro-batch {i} of decoder layer {layer} moved the RNG offset by {got - layout.starts[i][layer]}, "
                f"but the same micro-batch alone moved it by {layout.advances[i][layer]}: its dropout draws would not "
                "be those of layer-major accumulation (Note: [dropout in block-major order]).",
                _EXACT_INSTEAD,
            )

    def body_forward(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The decoder stack's forward: measure each micro-batch shape once, then lay out this call's offsets."""
        if _in_backward() or self.probing:
            return original(*args, **kwargs)
        if self.current is not None:  # Note: [one forward, one backward]
            raise PorosError(
                "A second forward that records gradients reached the decoder stack before the backward of the "
                "first; block-major dropout replay gives each forward's layers their offsets, and the first "
                "forward's recompute would take the second's.",
                "Run backward() after each forward (one loss per training step), or use micro_batches=1 with "
                "Trainer(accumulate_grad_batches=k), which is exact for any number of forwards.",
            )
        named = [kwargs.get(name) for name in ("input_ids", "inputs_embeds")]
        candidates = (*named, *args, *kwargs.values())
        lead = next((x for x in candidates if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
        if lead is None:
            return original(*args, **kwargs)
        rows = lead.shape[0]
        generator = self.rng(lead.device)

        def part(x: Any, start: int, n: int) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == rows:
                return x[start : start + n]
            if isinstance(x, tuple):
                return tuple(part(y, start, n) for y in x)
            return x

        def shape_key(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return (tuple(x.shape), x.dtype)
            if isinstance(x, tuple):
                return tuple(shape_key(y) for y in x)
            return None

        advances, start = [], 0
        for n in self.sizes(rows):
            a = [part(x, start, n) for x in args]
            kw = {name: part(v, start, n) for name, v in kwargs.items()}
            key = (tuple(shape_key(x) for x in a), tuple((name, shape_key(v)) for name, v in sorted(kw.items())))
            if key not in self.advances:
                self.advances[key] = self._measure(original, generator, a, kw)
            advances.append(self.advances[key])
            start += n
        offset = generator.get_offset()
        starts = []
        for adv in advances:
            row = []
            for step in adv:
                row.append(offset)
                offset += step
            starts.append(row)
        self.current = layout = _Layout(generator, starts, advances, offset)
        try:
            out = original(*args, **kwargs)
        except BaseException:
            self.current = None  # nothing of this forward will be differentiated
            raise
        finally:
            layout.open = False
        if generator.get_offset() != offset or len(layout.ran) != len(self.layer_index):
            raise PorosError(
                f"The decoder stack left the RNG offset at {generator.get_offset()} after running "
                f"{len(layout.ran)} of {len(self.layer_index)} layers; layer-major accumulation leaves it at "
                f"{offset} (Note: [dropout in block-major order]).",
                _EXACT_INSTEAD,
            )
        return out

    def finish(self) -> None:
        """At the end of the backward: the step drew nothing after the decoder stack, and the next forward may lay
        out its offsets (Note: [one forward, one backward])."""
        layout, self.current = self.current, None
        if layout is not None and layout.generator.get_offset() != layout.end:
            raise PorosError(
                f"Something after the decoder stack (the head, the loss) moved the RNG offset from {layout.end} to "
                f"{layout.generator.get_offset()}; layer-major accumulation would draw it between micro-batches, so "
                "the next micro-batches' dropout would differ (Note: [dropout in block-major order]).",
                "Draw no random numbers after the decoder (no dropout in the head or the loss), or use "
                "micro_batches=1 with Trainer(accumulate_grad_batches=k), which is exact.",
            )

    def _measure(
        self, original: Callable[..., Any], generator: Any, args: list[Any], kwargs: dict[str, Any]
    ) -> list[int]:
        """Each layer's offset advance for one micro-batch: the body runs it alone under ``no_grad``, then the
        offset goes back (Note: [dropout in block-major order])."""
        begin = generator.get_offset()
        self._probe, self._probe_generator = [], generator
        try:
            with torch.no_grad():
                original(*args, **kwargs)
            end, record = generator.get_offset(), self._probe
        finally:
            self._probe = self._probe_generator = None
            generator.set_offset(begin)
        self.probes += 1
        layers = [j for j, _, _ in record]
        if layers != list(range(len(self.layer_index))):
            raise PorosConfigError(
                f"One micro-batch through the decoder stack ran the layers {layers[:8]}..., not each of its "
                f"{len(self.layer_index)} layers once in order; block-major order cannot place its dropout draws.",
                _EXACT_INSTEAD,
            )
        edges = [begin, *(x for _, before, after in record for x in (before, after)), end]
        outside = sum(edges[i + 1] - edges[i] for i in range(0, len(edges), 2))
        if outside:
            raise PorosConfigError(
                "The decoder stack draws random numbers outside its decoder layers (an embedding or final dropout); "
                "block-major order runs that code once for all micro-batches and cannot draw as layer-major "
                "accumulation does.",
                "Set that dropout to 0, or use micro_batches=1 with Trainer(accumulate_grad_batches=k), which is exact.",
            )
        return [after - before for _, before, after in record]
