"""The timed training steps of a bench run: forward, loss, backward and update, with their peaks and phases.

A step trains on one batch of ``effective_batch`` rows: whole (one forward and backward), sample-major in
``accumulate`` chunks (a forward and backward per chunk, each loss divided by ``accumulate``, as Lightning's
``accumulate_grad_batches`` does), or block-major (the engine's micro-batches installed on the model: one forward
and backward over all rows, the loss the mean of the micro-batches' losses as accumulation computes it). Either
way there is one optimizer update per step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from poros_lightning.engine.gc_clock import CollectorClock
from poros_lightning.engine.microbatch import micro_batch_mean, micro_batch_sizes, micro_batches_of
from poros_lightning.engine.optim_state import HostOptimizerState
from poros_lightning.tools.bench.gpu_clocks import ClockSampler
from poros_lightning.tools.parity.runner import token_loss

__all__ = ["chunked_token_loss", "gc_timer", "host_speed", "install_micro_batches", "step_loop"]


@contextlib.contextmanager
def gc_timer(sink: dict[str, Any] | None) -> Iterator[Callable[[bool], None]]:
    """Time Python's garbage collector while the yielded ``on(True)`` holds: ``sink`` receives ``gc_collections`` and
    ``gc_seconds``, one entry per generation (2: the full collections, which scan every tracked object). A step
    bound by the host pays for each collection at full length."""
    clock = CollectorClock()  # engine/gc_clock.py, as the tuner times its steps

    def timing(on: bool) -> None:
        if on:
            clock.start()
        else:
            clock.stop()

    if sink is not None:  # live while the steps run: step_loop reads each step's share (gc_step_s)
        sink.update(gc_collections=clock.counts, gc_seconds=clock.by_generation)
    try:
        yield timing
    finally:
        clock.stop()
        if sink is not None:
            sink.update(gc_collections=clock.counts, gc_seconds=[round(x, 6) for x in clock.by_generation])


def host_speed(device: str, launches: int = 1000, loops: int = 100_000) -> dict[str, float]:
    """The host's own speed, measured just before a run's steps: the host time of one tiny kernel's launch, the device
    idle and the launches not waited for (``host_launch_us``), and of one iteration of a pure-Python loop
    (``host_python_ns``). A host-bound step that drifts between the runs of one process drifts with these where the
    host itself slowed, and not where the drift is the run's own."""
    x = torch.zeros(1, device=device)
    for _ in range(100):  # the kernel and the allocator warm
        x.add_(1)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    launch = (time.perf_counter() - t) / launches
    if device == "cuda":
        torch.cuda.synchronize()
    t, total = time.perf_counter(), 0
    for i in range(loops):
        total += i
    return {"host_launch_us": launch * 1e6, "host_python_ns": (time.perf_counter() - t) / loops * 1e9}


def install_micro_batches(model: torch.nn.Module, k: int, rows: int, device: torch.device | str) -> Any:
    """Install block-major micro-batches of ``rows`` rows, ``k`` per batch, on the PEFT ``model`` (before ``prepare``,
    as ``PorosStrategy(micro_batches=k)`` does, dropout replayed on CUDA); returns the installed splitter
    (``.uninstall()`` removes it)."""
    from poros_lightning.api import check_block_major, install_block_major

    replay = check_block_major(model, f"A bench run with micro_batches={k}", f"accumulate: {k}", device=device)
    return install_block_major(model, k, rows, replay_dropout=replay)


def chunked_token_loss(model: torch.nn.Module, ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """:func:`~poros_lightning.tools.parity.runner.token_loss` with the LM head and the loss computed
    ``chunk_tokens`` positions at a time, as ``LoRALightningModule(loss_chunk_tokens=...)`` computes it (the decoder
    stack, then :func:`~poros_lightning.training.chunked_loss.peft_chunked_loss`; one loss per block-major
    micro-batch when block-major micro-batches are installed)."""
    from poros_lightning.arch import arch_for_model, resolve
    from poros_lightning.training.chunked_loss import final_logit_softcap, peft_chunked_loss

    base = model.get_base_model()
    spec = arch_for_model(base, allow_unlisted=True)
    hidden = resolve(base, spec.body)(input_ids=ids, use_cache=False).last_hidden_state
    softcap = final_logit_softcap(base.config, spec)
    return peft_chunked_loss(model, hidden, ids, resolve(base, spec.head), chunk_tokens, softcap=softcap)


def _recorder(events: list[Any], stamps: list[float]) -> Callable[[], None]:
    """A ``mark()`` that records the next of ``events`` on the current stream (nothing without events) and
    appends the host's clock to ``stamps``."""
    pending = iter(events)

    def mark() -> None:
        if events:
            next(pending).record()
        stamps.append(time.perf_counter())

    return mark


def step_loop(
    model: torch.nn.Module,
    batches: list[torch.Tensor],
    warmup: int,
    vocab: int,
    device: str,
    ring: Any = None,
    head: Any = None,
    optimizer_on_host: bool = False,
    peaks: dict[str, float] | None = None,
    issued: list[float] | None = None,
    split: dict[str, list[float]] | None = None,
    host_split: dict[str, list[float]] | None = None,
    counts: dict[str, Any] | None = None,
    profile: dict[str, Any] | None = None,
    tuner: Any = None,
    accumulate: int = 1,
    loss_chunk_tokens: int | None = None,
    optimizer: str = "adamw",
    optimizer_prefetch: bool = True,
    memtrace: dict[str, Any] | None = None,
    precision: str = "32-true",
) -> list[float]:
    """Train on ``batches``; returns the synchronized wall time of each step after ``warmup``.

    Each batch is one step: ``accumulate > 1`` splits it into that many chunks run one after the other
    (sample-major), and a model with block-major micro-batches installed runs it as those (module docstring).
    With ``accumulate > 1`` the ``forward`` phase holds every chunk's forward and backward, and ``backward`` is 0.
    ``optimizer``: ``"adamw"`` (``torch.optim.AdamW``) or ``"paged_adamw_8bit"`` (bitsandbytes' paged 8-bit AdamW,
    the optimizer of the common resident QLoRA recipe; CUDA only). ``optimizer_prefetch=False`` copies the state of
    ``optimizer_on_host`` in after the backward, as ``PorosStrategy`` does under block-major micro-batches.
    ``loss_chunk_tokens`` computes the LM head and the loss that many tokens at a time, as
    ``LoRALightningModule(loss_chunk_tokens=...)`` does (:func:`chunked_token_loss`): the full logits never exist.
    ``precision="bf16-mixed"`` runs each forward and its loss under bf16 autocast, as ``Trainer(precision=
    "bf16-mixed")`` does with ``PorosPrecision`` (the LoRA matmuls in bf16 on fp32 weights); ``"32-true"`` without.

    With a slot ``ring``, its copies are timed from the first timed step on (see ``SlotRing.time_copies``).
    ``peaks`` (CUDA) receives the peak allocated bytes of the forward and backward (``forward_backward``)
    and of the optimizer update (``update``), over all steps: the profile of where the peak sits; and the
    peak the caching allocator reserved (``reserved``). ``issued`` receives, for each timed step, the
    seconds the host took to issue it (until the final synchronization): close to the step time when the
    step is bound by the host launching kernels rather than by the GPU (host waits inside the step, such
    as ``optimizer_on_host``'s synchronization, count as issuing). ``split`` (CUDA) receives, for each timed
    step, the GPU seconds of its ``forward`` (model and loss), ``backward`` and ``update``, from CUDA events
    on the compute stream: where a streamed step spends the time a resident one does not. ``host_split``
    receives the same phases on the host's clock: how long the host took to issue each (a phase whose
    host time equals its GPU time held the host back, e.g. by filling the queue of kernel launches). ``counts``
    receives ``gc_collections`` and ``gc_seconds`` (:func:`gc_timer`, the timed steps), ``optimizer_prefetches``
    (the steps whose backward started the optimizer state's copy in),
    ``ring_loads`` and ``copy_stats`` (the ``ring``'s count and timing of copies), ``head_loads`` (the
    host ``head``'s copies), as they stood after the timed steps, and (CUDA) ``gpu_clocks``, the GPU's clocks
    while the timed steps ran (:class:`~poros_lightning.tools.bench.gpu_clocks.ClockSampler`).
    ``profile`` (CUDA) receives the summary of one more step run under the CUDA profiler, after the
    timed ones (:func:`~poros_lightning.tools.bench.timeline.profile_step`): where that step's GPU time went.
    ``memtrace`` (CUDA) likewise receives what was allocated at the peak of one more step, and where
    (:func:`~poros_lightning.tools.bench.memtrace.record_step`).

    Each step is timed until the compute stream has finished it: copies on side streams that a training
    loop overlaps with the next step (``optimizer_on_host``'s copy out) run on into the next step's time,
    as they do in training; what is still running after the last step counts in that step's time.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "paged_adamw_8bit":
        import bitsandbytes as bnb

        opt = bnb.optim.PagedAdamW8bit(params, lr=1e-4)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4)
    host = HostOptimizerState(opt, prefetch_at=0.25 if optimizer_prefetch else None) if optimizer_on_host else None
    cuda = device == "cuda"
    phases = peaks if peaks is not None else {}
    phases.update(forward_backward=0, update=0, reserved=0)
    step_peak = {"allocated": 0, "reserved": 0}  # since the tuner's last reset (see below)

    def phase_end(name: str) -> None:
        if cuda:  # the allocator's bookkeeping is host-side: no synchronization
            phases[name] = max(phases[name], torch.cuda.max_memory_allocated())
            phases["reserved"] = max(phases["reserved"], torch.cuda.max_memory_reserved())
            step_peak["allocated"] = max(step_peak["allocated"], torch.cuda.max_memory_allocated())
            step_peak["reserved"] = max(step_peak["reserved"], torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()

    if tuner is not None:  # the strategy's tuner (engine/tuner.py) reads the peaks these phases keep
        tuner.stats = lambda: (
            step_peak["allocated"],
            step_peak["reserved"],
            int(torch.cuda.memory_stats().get("num_alloc_retries", 0)),
        )
        tuner.reset = lambda: step_peak.update(allocated=0, reserved=0)

    def wait() -> None:  # the compute stream only (see above)
        if cuda:
            torch.cuda.current_stream().synchronize()

    def loss_of(ids: torch.Tensor, k: int = 1) -> torch.Tensor:
        """The batch's loss: one per micro-batch, averaged as accumulation does, when ``k`` block-major ones run."""
        if precision == "bf16-mixed":  # as PorosPrecision.forward_context
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, cache_enabled=False):
                return _loss_of(ids, k)
        return _loss_of(ids, k)

    def _loss_of(ids: torch.Tensor, k: int = 1) -> torch.Tensor:
        if loss_chunk_tokens:
            return chunked_token_loss(model, ids, loss_chunk_tokens)
        logits = model(input_ids=ids, use_cache=False).logits
        if k > 1:  # block-major: one forward over all micro-batches, their losses averaged as accumulation does
            return micro_batch_mean(token_loss, k, logits, ids, sizes=micro_batch_sizes(model, len(ids)))[0]
        return token_loss(logits, ids)

    def step(ids: torch.Tensor, mark: Callable[[], None]) -> None:
        mark()
        if host is not None:
            host.arm()
        k = micro_batches_of(model)
        if accumulate > 1:  # sample-major: a forward and backward per chunk
            for chunk in ids.chunk(accumulate):
                (loss_of(chunk) / accumulate).backward()
            mark()
        else:
            loss = loss_of(ids, k)
            mark()
            loss.backward()
        mark()
        phase_end("forward_backward")
        if host is not None:
            host.to_device()
        opt.step()
        if host is not None:
            host.to_host()
        opt.zero_grad(set_to_none=True)
        mark()
        phase_end("update")

    times = []
    clocks = ClockSampler.of_device(torch.cuda.current_device()) if cuda else None
    try:
        with gc_timer(counts) as timing:
            for i, ids in enumerate(batches):
                if tuner is not None:
                    if i == warmup:  # the timed steps run the plan the warm-up steps fitted (and the last one verified)
                        tuner.finish()
                    else:
                        tuner.step_boundary()
                timing(i >= warmup)  # the collector during the timed steps only
                ids = ids.to(device, non_blocking=True)
                wait()
                if ring is not None and i == warmup:
                    ring.time_copies()
                if clocks is not None and i == warmup:
                    clocks.start()
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else []
                stamps: list[float] = []
                collected = sum(counts["gc_seconds"]) if counts is not None else 0.0
                t = time.perf_counter()
                step(ids, _recorder(marks, stamps))
                done_issuing = time.perf_counter()
                wait()
                if i >= warmup:
                    times.append(time.perf_counter() - t)
                    if counts is not None:  # the collector's seconds in this step (Note: [the collector's time])
                        counts.setdefault("gc_step_s", []).append(sum(counts["gc_seconds"]) - collected)
                    if issued is not None:
                        issued.append(done_issuing - t)
                    if host_split is not None:
                        for name, a, b in zip(("forward", "backward", "update"), stamps, stamps[1:], strict=False):
                            host_split.setdefault(name, []).append(b - a)
                    if split is not None and marks:
                        for name, (a, b) in zip(
                            ("forward", "backward", "update"), zip(marks, marks[1:], strict=False), strict=True
                        ):
                            split.setdefault(name, []).append(a.elapsed_time(b) / 1e3)
            timing(False)
        if cuda and times:
            t = time.perf_counter()
            torch.cuda.synchronize()
            times[-1] += time.perf_counter() - t
        if clocks is not None and counts is not None:
            counts["gpu_clocks"] = clocks.stop()  # the timed steps' (Note: [clocks] in gpu_clocks.py)
        # What the timed steps copied, before a profiled step adds to it.
        if ring is not None and counts is not None:
            counts["ring_loads"] = ring.loads
            counts["copy_stats"] = ring.copy_stats()
            ring.time_copies(False)
        if head is not None and counts is not None:
            counts["head_loads"] = head.loads
        if host is not None and counts is not None:
            counts["optimizer_prefetches"] = host.prefetches
        if cuda and batches and (profile is not None or memtrace is not None):
            from poros_lightning.tools.bench.memtrace import record_step
            from poros_lightning.tools.bench.timeline import profile_step

            ids = batches[-1].to(device)
            kept = dict(phases)  # the peaks are the timed steps'
            for sink, run_once in ((profile, profile_step), (memtrace, record_step)):
                if sink is not None:  # one more step each, after the timed ones
                    sink.update(run_once(lambda mark: step(ids, mark)))
            phases.update(kept)
    finally:
        if clocks is not None:
            clocks.close()
        if tuner is not None:  # a step that raised leaves its tuner measuring: stopped, nothing left hooked
            tuner.close()
        if host is not None:  # a step that raised (out of memory) leaves no trigger hook for the model's next run
            host.close()
    opt.state.clear()
    return times
