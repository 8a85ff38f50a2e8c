"""Benchmark harness: resident and streamed QLoRA steps side by side, in one process.

Each method builds the same random-init model (``parity.build``), burns in, then times synchronized
optimizer steps. Peak device memory counts from the first training step (after the model is built
and, for ``poros``, prepared), so it measures training, not loading. Results are JSON-ready dicts.
"""

from __future__ import annotations

import gc
import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from poros_lightning.engine.link import measure_h2d
from poros_lightning.quant.hf_config import hf_config
from poros_lightning.tools.bench.oom import AT_FAILURE, free_blocks, oom_line, watch_oom
from poros_lightning.tools.bench.steps import host_speed, install_micro_batches, step_loop
from poros_lightning.tools.parity.build import build_peft_model

__all__ = ["METHODS", "bench_methods", "measure_h2d", "write_jsonl"]

METHODS = ("poros", "resident", "resident_gc")


def _host_rss() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1e9


def _checkpointing(model: Any, *, enable: bool) -> None:
    """Hugging Face activation checkpointing (non-reentrant) on or off, under transformers' current names.

    transformers 5.x renamed ``gradient_checkpointing_*`` to ``activation_checkpointing_*`` (the old names warn);
    older releases have only the old ones.
    """
    if enable:
        new, kwargs = getattr(model, "activation_checkpointing_enable", None), {"use_reentrant": False}
        if new is not None:
            new(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def bench_methods(
    config: dict[str, Any],
    runs: list[dict[str, Any]],
    *,
    seq_len: int = 512,
    batch_size: int = 1,
    lora_r: int = 16,
    steps: int = 10,
    warmup: int = 3,
    quantization: str = "nf4-dq",
    blockwise: bool | None = None,
    compile_layers: bool = False,
    profile: bool = False,
    memtrace: bool = False,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Build the model once and time each run of ``runs`` on it, in order.

    Each run is a dict with ``method`` (one of :data:`METHODS`), an optional ``name``, engine options
    for ``poros`` (``block_size``, ``prefetch``, ``resident_blocks``, ``keep_activations``,
    ``embeddings_on_host``, ``head_on_host``, ``head_copies``, ``inputs_on_host``), an optional ``accumulate``
    (micro-batches of ``batch_size`` rows per step, one after the other: sample-major, as Lightning's
    ``accumulate_grad_batches``) and ``micro_batches`` (``poros`` only: per block, block-major, as
    ``PorosStrategy(micro_batches=k)``); rows carry both, ``effective_batch`` (rows per optimizer step) and
    ``tokens_per_s`` over the effective batch. An optional
    ``optimizer_on_host`` (AdamW state in host memory between steps, as ``PorosStrategy`` does) and an
    optional ``memory_cap_gb`` (``torch.cuda.set_per_process_memory_fraction``: emulates a smaller
    card; a run that does not fit is recorded with ``"oom": true``), or a ``vram_budget`` (``"24GB"``:
    the planner of ``PorosStrategy(vram_budget=...)`` picks the engine options and ``optimizer_on_host``,
    and the run is capped at the budget; a budget the planner refuses is recorded with ``"refused": true``
    and the smallest budget it accepts, ``min_budget_gb``, and the planner's ``fix``, without running; the warm-up steps then fit the plan
    to the card, engine/tuner.py, unless ``tune: false``; ``trade: false`` keeps the planned resident blocks).
    Either way the next run goes on. Every row has ``vram_budget`` (GB, or None), ``planned_peak_gb`` (the plan's estimate, or None),
    and a tuned row ``final_planned_peak_gb`` (the estimate of the plan the tuner settled on; each ``tuned`` step
    carries its own plan's, ``planned_gb``, beside its measured ``peak_allocated_gb``),
    ``refused``, ``oom`` and ``s_per_step`` (None when nothing ran); a planned row also has the planner's
    reasoning (``plan``) beside the engine options it chose (the row's option fields). ``compile_layers``:
    every run computes with each decoder layer under ``torch.compile``
    (:func:`~poros_lightning.training.compiling.compile_layers`). Between runs the adapter is reset and the
    model returns to resident, so every method trains the same bytes. ``blockwise``: see
    :func:`~poros_lightning.tools.parity.build.build_peft_model` (``None``: when bf16 would not fit). ``profile``
    (CUDA): each run profiles one more step after its timed ones and adds its per-phase summary to the row
    as ``profile_*`` fields (:func:`~poros_lightning.tools.bench.timeline.summarize_trace`); ``memtrace`` (CUDA),
    what was allocated at one more step's peak, as ``memtrace_*`` fields (tools/bench/memtrace.py). ``on_row`` is
    called with each row as soon as its run ends (a run killed later loses nothing already measured).
    """
    from poros_lightning.api import engine_of, input_grads_hooked, prepare, unprepare

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and any("vram_budget" in run for run in runs):  # the allocator PorosStrategy's plans use
        import logging

        from poros_lightning.lightning.planning import use_expandable_segments

        use_expandable_segments(torch.device("cuda"), logging.getLogger(__name__))
    if device == "cuda":
        watch_oom()
    model = build_peft_model(config, device=device, lora_r=lora_r, quantization=quantization, blockwise=blockwise)
    if compile_layers:
        from poros_lightning.training.compiling import compile_layers as compile_each_layer

        compile_each_layer(model)
    # The initial adapter waits in host memory: a device copy would count in every run's peak.
    init = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}
    vocab = int(model.get_base_model().config.get_text_config().vocab_size)
    data: dict[int, list[torch.Tensor]] = {}  # per effective batch: the same token batches for every run

    def batches_of(rows: int) -> list[torch.Tensor]:
        if rows not in data:
            gen = torch.Generator().manual_seed(0)
            data[rows] = [torch.randint(0, vocab, (rows, seq_len), generator=gen) for _ in range(warmup + steps)]
        return data[rows]

    total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 0
    rows = []
    for run in runs:
        method = run["method"]
        AT_FAILURE.clear()
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; use one of {METHODS}")
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(init[n])
        engine_opts = {
            k: run[k]
            for k in (
                "block_size",
                "prefetch",
                "resident_blocks",
                "keep_activations",
                "embeddings_on_host",
                "head_on_host",
                "head_copies",
                "head_prefetch",
                "inputs_on_host",
            )
            if k in run
        }
        optimizer_on_host = bool(run.get("optimizer_on_host"))
        accumulate, micro = int(run.get("accumulate", 1)), int(run.get("micro_batches", 1))
        loss_chunk = run.get("loss_chunk_tokens")  # the LM head and the loss in chunks of this many tokens
        optimizer, precision = run.get("optimizer", "adamw"), run.get("precision", "32-true")
        if micro > 1 and method != "poros":
            raise ValueError(f"micro_batches (block-major) is an engine option; run {method!r} takes accumulate")
        effective_batch = batch_size * accumulate * micro
        memory_cap = run.get("memory_cap_gb")
        planned: dict[str, Any] = {"vram_budget": None, "planned_peak_gb": None}
        plan = None
        refusal: dict[str, Any] | None = None
        if optimizer == "paged_adamw_8bit" and device != "cuda":  # an answer, recorded as a row
            refusal = {"refused": True, "refusal": "paged_adamw_8bit pages its state through CUDA memory: CUDA only"}
        if run.get("vram_budget") is not None:
            from poros_lightning.errors import PorosOOMError
            from poros_lightning.memory.budget import minimum_budget
            from poros_lightning.memory.options import resolve
            from poros_lightning.memory.planner import parse_bytes, plan_engine

            # Block-major: the planner counts every micro-batch's layer inputs, a recompute one micro-batch's.
            planning = dict(seq_len=seq_len, batch_size=batch_size, lora_r=lora_r, quantization=quantization)
            planning["micro_batches"] = micro
            planning["loss_chunk_tokens"] = loss_chunk
            planning["workspace_bytes"] = None if device == "cuda" else 0  # cuBLAS's: CUDA only
            full = hf_config(config).to_dict()  # the planner reads every key: the transformers defaults filled in
            # "min": the smallest budget the planner accepts (every host-side option on), the minimum-memory plan
            is_min = str(run["vram_budget"]).strip().lower() == "min"
            budget = minimum_budget(full, **planning) if is_min else parse_bytes(run["vram_budget"])
            planned["vram_budget"] = budget / 1e9
            link = measure_h2d(nbytes=256 << 20, repeats=3) if device == "cuda" else None  # as PorosStrategy
            try:
                plan = plan_engine(full, budget, **planning, link_gbps=link)
            except PorosOOMError as err:  # the strategy refuses it too: an answer, recorded as one
                smallest = minimum_budget(full, **planning)
                refusal = {"refused": True, "min_budget_gb": smallest / 1e9, "refusal": err.problem, "fix": err.hint}
            else:
                # Options the run sets win over the plan's, as they do in PorosStrategy; the plan's lines name them.
                explicit = {**engine_opts, "optimizer_on_host": run.get("optimizer_on_host")}
                chosen, notes = resolve(explicit, plan.options())
                engine_opts = {k: chosen[k] for k in plan.engine_kwargs()}
                optimizer_on_host = bool(chosen["optimizer_on_host"])
                memory_cap = memory_cap or budget / 1e9
                planned.update(planned_peak_gb=plan.vram_estimate / 1e9, plan=[*plan.explanation, *notes])
        row: dict[str, Any] = {
            "method": run.get("name", method),
            "base_method": method,
            "seq_len": seq_len,
            "batch_size": batch_size,
            "accumulate": accumulate,
            "micro_batches": micro,
            "effective_batch": effective_batch,
            "loss_chunk_tokens": loss_chunk,
            "optimizer": optimizer,
            "precision": precision,
            "lora_r": lora_r,
            "quantization": quantization,
            "steps": steps,
            "warmup": warmup,
            **engine_opts,
            "optimizer_on_host": optimizer_on_host,
            "compile_layers": compile_layers,
            "initial_adapter": "host",  # rows without this field counted a device copy of it in their peak
            **({"round": run["round"]} if "round" in run else {}),
            **planned,
            "refused": False,
        }
        if refusal is not None:
            row.update(refusal, oom=False, s_per_step=None, peak_vram_gb=None, peak_reserved_gb=None)
            rows.append(row)
            if on_row is not None:
                on_row(row)
            continue
        if method == "resident_gc":
            _checkpointing(model, enable=True)  # transformers 5 makes the embeddings' output require grad with it
            if not input_grads_hooked(model):
                model.enable_input_require_grads()
        elif method == "poros":
            splitter = install_micro_batches(model, micro, batch_size, device) if micro > 1 else None
            prepare(model, device=device, **engine_opts)
        gc.collect()
        row["gc_freeze"] = frozen = bool(run.get("gc_freeze"))  # as PorosStrategy(gc_freeze=True): setup's objects
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            if memory_cap:
                torch.cuda.set_per_process_memory_fraction(min(1.0, memory_cap * 1e9 / total))
                row["memory_cap_gb"] = memory_cap
        engine = engine_of(model)
        tuner = None
        if (
            engine is not None
            and device == "cuda"
            and "vram_budget" in run
            and refusal is None
            and run.get("tune", True)
        ):
            from poros_lightning.engine.tuner import PlanTuner
            from poros_lightning.memory.planner import resident_pays

            tuner = PlanTuner(
                set_keep=engine.set_keep_activations, keep=engine.options.keep_activations,
                num_layers=len(engine.layers), budget=int(planned["vram_budget"] * 1e9),
                layer_bytes=max(plan.activation_layer_bytes, 1), device=engine.device, steps=warmup, log=print,
                set_resident=None if "resident_blocks" in run or not run.get("trade", True) else engine.set_resident_blocks,
                resident=engine.options.resident_blocks, num_blocks=engine.num_blocks,
                block_bytes=engine.store.max_block_bytes, timings=engine.timings, timer=engine.time_steps,
                pays=resident_pays,
            )  # fmt: skip
        retries0 = int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if device == "cuda" else 0
        loads0 = engine.ring.loads if engine is not None else 0
        head = engine.host_head if engine is not None else None
        head0 = head.loads if head is not None else 0
        try:
            if frozen:  # left out of every later collection; thawed in finally
                gc.freeze()
            ring = engine.ring if engine is not None else None
            peaks: dict[str, float] = {}
            issued: list[float] = []
            split: dict[str, list[float]] = {}
            host_split: dict[str, list[float]] = {}
            counts: dict[str, Any] = {}
            profiled: dict[str, Any] | None = {} if profile else None
            traced: dict[str, Any] | None = {} if memtrace else None
            row.update(host_speed(device))  # beside the steps: drift of the host itself between runs
            times = step_loop(
                model,
                batches_of(effective_batch),
                warmup,
                vocab,
                device,
                ring,
                head,
                optimizer_on_host=optimizer_on_host,
                peaks=peaks,
                issued=issued,
                split=split,
                host_split=host_split,
                counts=counts,
                profile=profiled,
                tuner=tuner,
                accumulate=accumulate,
                loss_chunk_tokens=loss_chunk,
                precision=precision,
                optimizer=optimizer,
                optimizer_prefetch=micro == 1,  # as PorosStrategy (Note: [when the state moves])
                memtrace=traced,
            )
            s_per_step = sum(times) / len(times)
            if tuner is not None:
                tuned = PlanTuner.summary(tuner.history)
                if plan is not None:  # each measured plan priced by the planner's model, beside its measured peak
                    block = engine.store.max_block_bytes
                    for entry in tuned:
                        priced = plan.estimate_with(entry["keep_activations"], entry["resident_blocks"], block)
                        entry["planned_gb"] = round(priced / 1e9, 3)
                    row["final_planned_peak_gb"] = round(plan.estimate_with(tuner.keep, tuner.resident, block) / 1e9, 3)
                row.update(tuned=tuned, keep_activations=tuner.keep, resident_blocks=tuner.resident)
            if device == "cuda":
                row["alloc_retries"] = int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) - retries0
            row.update(
                oom=False,
                s_per_step=s_per_step,
                s_per_step_min=min(times),
                step_s=[round(t, 4) for t in times],
                host_issue_s_per_step=sum(issued) / len(issued),
                **{f"{name}_s_per_step": sum(v) / len(v) for name, v in split.items()},
                **{f"host_{name}_s_per_step": sum(v) / len(v) for name, v in host_split.items()},
                tokens_per_s=effective_batch * seq_len / s_per_step,
                peak_vram_gb=max(peaks["forward_backward"], peaks["update"]) / 1e9 if device == "cuda" else None,
                peak_forward_backward_gb=peaks["forward_backward"] / 1e9 if device == "cuda" else None,
                peak_update_gb=peaks["update"] / 1e9 if device == "cuda" else None,
                peak_reserved_gb=peaks["reserved"] / 1e9 if device == "cuda" else None,
                host_rss_gb=_host_rss(),
                gpu_clocks=counts.get("gpu_clocks"),  # CUDA: tools/bench/gpu_clocks.py
                **{f"profile_{k}": v for k, v in (profiled or {}).items()},
                **{f"memtrace_{k}": v for k, v in (traced or {}).items()},
            )
            if "gc_seconds" in counts:  # Python's collector in the timed steps (steps.gc_timer)
                row.update(gc_s_per_step=sum(counts["gc_seconds"]) / len(times),
                           gc_full_per_step=counts["gc_collections"][2] / len(times),
                           gc_step_s=[round(x, 4) for x in counts.get("gc_step_s", [])])  # fmt: skip
            if "optimizer_prefetches" in counts:
                row["optimizer_prefetches_per_step"] = counts["optimizer_prefetches"] / (warmup + steps)
            if engine is not None:
                copies = counts["ring_loads"] - loads0
                timed = counts["copy_stats"]
                if head is not None:
                    row.update(
                        head_loads_per_step=(counts["head_loads"] - head0) / (warmup + steps), head_mb=head.nbytes / 1e6
                    )
                row.update(
                    num_blocks=engine.num_blocks,
                    resident_at=engine.ring.resident_at,  # where the resident blocks sit (engine/slots.py)
                    block_mb=engine.store.max_block_bytes / 1e6,
                    host_store_gb=engine.store.total_bytes / 1e9,
                    pinned=engine.store.pinned,
                    loads_per_step=copies / (warmup + steps),
                    h2d_gbps=copies / (warmup + steps) * engine.store.max_block_bytes / s_per_step / 1e9,
                    h2d_copy_gbps=timed["gbps"] if engine.ring.use_streams else None,  # timed on the copy stream
                    copy_busy_fraction=timed["seconds"] / sum(times) if engine.ring.use_streams else None,
                )
        except torch.OutOfMemoryError as err:  # the row keeps what ran out, and where: the estimate's error
            row.update(oom=True, s_per_step=None, peak_vram_gb=None, peak_reserved_gb=None, oom_error=oom_line(err))
            if tuner is not None:  # the plans measured before it, and the plan that ran out
                row.update(tuned=PlanTuner.summary(tuner.history), keep_activations=tuner.keep)
                row.update(resident_blocks=tuner.resident)
                engine.time_steps(False)
            if device == "cuda":
                row.update(
                    oom_peak_allocated_gb=torch.cuda.max_memory_allocated() / 1e9,
                    oom_reserved_gb=torch.cuda.memory_reserved() / 1e9,
                    oom_at=traceback.format_exc(limit=-4).splitlines()[-6:-1],
                )
                row.update(AT_FAILURE or free_blocks())  # at the failure where it was seen, else now
        finally:
            if device == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0)
            if frozen:
                gc.unfreeze()
            if method == "resident_gc":
                _checkpointing(model, enable=False)
                # the hook stays otherwise (PEFT-wrapped): the next runs would hold the embeddings' output and a
                # gradient of it through their update, two tokens x hidden tensors their plans do not have
                model.get_base_model().disable_input_require_grads()
            elif method == "poros":
                unprepare(model, device=device)
                if splitter is not None:
                    splitter.uninstall()
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        if on_row is not None:
            on_row(row)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Append ``rows`` to ``path`` as JSON lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
