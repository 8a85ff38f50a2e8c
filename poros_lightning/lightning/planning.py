"""The strategies' side of planning: the budget, the plan for it, its log block, and the tuner of the first steps.

Rule (Note: [who decides] in memory/options.py): a plan chooses every engine option the user left unset; what
the user set wins. The budget is ``"auto"`` by default: the device's free memory at setup (within a
per-process cap such as ``torch.cuda.set_per_process_memory_fraction``) less a stated margin.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from poros_lightning.api import input_grads_hooked
from poros_lightning.engine.link import measure_h2d
from poros_lightning.errors import PorosConfigError
from poros_lightning.memory.options import AUTO_MARGIN_BYTES, AUTO_MARGIN_FRACTION, auto_budget, resolve
from poros_lightning.memory.planner import EnginePlan, format_bytes, parse_bytes, plan_engine, resident_pays

__all__ = ["check_budget", "device_budget", "plan_for", "plan_record", "tuner_for", "use_expandable_segments"]

_OFF = ("off", "none", "")
_LINKS: dict[torch.device, float] = {}


def check_budget(value: str | int | None) -> None:
    """Refuse a budget that is neither ``"auto"``, ``"off"`` nor a size, at construction."""
    if value is None or (isinstance(value, str) and value.strip().lower() in (*_OFF, "auto")):
        return
    parse_bytes(value)


def device_budget(value: str | int | None, device: torch.device) -> int | None:
    """Bytes the plan may use on ``device``; ``None`` means no plan (``"off"``, or ``"auto"`` off CUDA)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        if device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(device)
        fraction = torch.cuda.get_per_process_memory_fraction(device)
        # What this process holds counts against its cap; its allocator's free cached blocks do not.
        cap = round(fraction * total) - torch.cuda.memory_allocated(device) if fraction < 1.0 else None
        return auto_budget(free, cap)
    return parse_bytes(value)


def _set_allocator_settings(settings: str) -> None:
    """The caching allocator's runtime settings: the accelerator-wide call where torch has it (2.10+), else CUDA's."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


def use_expandable_segments(device: torch.device, log: logging.Logger) -> bool:
    """Let the caching allocator grow segments in place (less fragmentation) unless the user configured it.

    A card's limit is on what the allocator reserves; with fixed-size segments a long sequence's activations
    leave reserved-but-unusable gaps that the estimate cannot see (about 1 GB at 7B, seq 2048). Expandable
    segments map more memory into one segment instead. Blocks keep their alignment, so kernels and results
    do not change. ``PYTORCH_CUDA_ALLOC_CONF`` set by the user is left alone.
    """
    import os

    if device.type != "cuda" or "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return False
    _set_allocator_settings("expandable_segments:True")
    torch.cuda.empty_cache()  # free fixed segments cached so far go back: no later tensor splits them
    log.info("poros plan: the CUDA caching allocator uses expandable segments (set PYTORCH_CUDA_ALLOC_CONF to choose)")
    return True


def _link_gbps(device: torch.device, log: logging.Logger) -> float | None:
    """The pinned host-to-device bandwidth measured on ``device`` (None off CUDA, or if pinning fails).

    Measured once per device and process: every plan of the process then sees the same link.
    """
    if device.type != "cuda":
        return None
    if device in _LINKS:
        return _LINKS[device]
    try:
        with torch.cuda.device(device):
            _LINKS[device] = measure_h2d(nbytes=256 << 20, repeats=3)
            return _LINKS[device]
    except RuntimeError as err:  # pinned memory can be restricted (containers, ulimit -l)
        log.warning("poros plan: could not measure the host-to-device link (%s); assuming the default", err)
        return None


def _input_grads_bytes(base: nn.Module, tokens: int) -> int:
    """What ``enable_input_require_grads`` (gradient checkpointing, ``prepare_model_for_kbit_training``) makes a step
    hold that no plan counts: the embeddings' output, made a leaf that requires grad, and its gradient, both kept
    until the graph is freed (after the update, in Lightning). 0 without the hook."""
    if not input_grads_hooked(base):
        return 0
    embed = base.get_input_embeddings()
    weight = getattr(embed, "weight", None)
    hidden = int(weight.shape[-1]) if weight is not None else int(base.config.get_text_config().hidden_size)
    return 2 * tokens * hidden * (weight.element_size() if weight is not None else 2)


def plan_for(strategy: Any, peft_model: nn.Module, trainer: Any, log: logging.Logger) -> EnginePlan | None:
    """The plan for ``peft_model`` under the strategy's budget, logged as one block (``None``: no plan)."""
    device = strategy.root_device
    budget = device_budget(strategy.vram_budget, device)
    if budget is None:
        if str(strategy.vram_budget).lower() == "auto":
            log.info("poros plan: no device budget on %s; engine defaults and the options you set", device)
        return None
    use_expandable_segments(device, log)
    data = getattr(trainer, "datamodule", None) if trainer is not None else None
    seq_len = strategy.seq_len if strategy.seq_len is not None else getattr(data, "seq_len", None)
    if seq_len is None:
        raise PorosConfigError(
            f"PorosStrategy(vram_budget={strategy.vram_budget!r}) needs the sequence length to plan for.",
            "Pass PorosStrategy(seq_len=N), use a datamodule with a `seq_len` attribute, or vram_budget='off'.",
        )
    base = peft_model.get_base_model()
    lora = next(iter(peft_model.peft_config.values()))
    head = base.get_output_embeddings() if callable(getattr(base, "get_output_embeddings", None)) else None
    batch = int(getattr(data, "batch_size", 1) or 1) if data is not None else 1
    held = _input_grads_bytes(base, batch * int(seq_len))
    plan = plan_engine(
        base.config.to_dict(),
        budget - held,
        seq_len=int(seq_len),
        # block-major: the data's batches hold micro_batches micro-batches (PorosStrategy checks the multiple)
        batch_size=max(batch // strategy.micro_batches, 1),
        micro_batches=strategy.micro_batches,
        lora_r=int(lora.r),
        quantization=strategy.quantization,
        head_frozen=not getattr(getattr(head, "weight", None), "requires_grad", False),
        link_gbps=_link_gbps(device, log),
        # LoRALightningModule(loss_chunk_tokens=...): the logits of one chunk at a time
        loss_chunk_tokens=getattr(strategy.lightning_module, "loss_chunk_tokens", None),
        workspace_bytes=None if device.type == "cuda" else 0,  # cuBLAS's, CUDA only: Note: [cuBLAS workspaces]
    )
    _, overridden = resolve(strategy.explicit, plan.options())
    how = (
        f"auto: free memory less max({format_bytes(AUTO_MARGIN_BYTES)}, {AUTO_MARGIN_FRACTION:.0%})"
        if str(strategy.vram_budget).lower() == "auto"
        else f"vram_budget={strategy.vram_budget!r}"
    )
    lines = [f"budget {format_bytes(budget)} ({how}), seq_len {seq_len}, batch {batch}"]
    if held:
        lines.append(
            f"planned against {format_bytes(budget - held)}: the input embeddings' require-grads hook keeps their "
            f"output and a gradient of it through the backward and the update ({format_bytes(held)}; "
            "model.disable_input_require_grads() frees it)"
        )
    lines += plan.explanation
    lines += overridden
    chosen, _ = resolve(strategy.explicit, plan.options())
    lines.append("options: " + ", ".join(f"{k}={v}" for k, v in chosen.items()))
    log.info("poros plan for %s:\n  %s", type(base).__name__, "\n  ".join(lines))
    peft_model._poros_plan = plan_record(plan, budget, how, overridden, chosen)
    return plan


def plan_record(plan: EnginePlan, budget: int, how: str, overridden: list[str], chosen: dict[str, Any]) -> dict:
    """The plan as written next to the adapter and into checkpoints (JSON-able)."""
    return {
        "vram_budget_bytes": budget,
        "budget_from": how,
        "estimated_peak_bytes": plan.vram_estimate,
        "explanation": list(plan.explanation),
        "set_explicitly": overridden,
        "options": {k: v for k, v in chosen.items() if not isinstance(v, float)},
        "tuned": [],
    }


def tuner_for(strategy: Any, peft_model: nn.Module, log: logging.Logger) -> Any:
    """A :class:`~poros_lightning.engine.tuner.PlanTuner` for a planned CUDA run whose kept layers are not set."""
    from poros_lightning.api import engine_of
    from poros_lightning.engine.tuner import PlanTuner

    record = getattr(peft_model, "_poros_plan", None)
    engine = engine_of(peft_model)
    if (
        record is None
        or engine is None
        or engine.device.type != "cuda"
        or strategy.tune_steps < 1
        or "keep_activations" in strategy.explicit
        or not strategy.plans
        or engine.options.keep_activations < 0
        or getattr(peft_model.get_base_model().config.get_text_config(), "num_kv_shared_layers", 0)
    ):
        return None
    plan = strategy.plans[-1]

    def set_keep(keep: int) -> None:
        engine.set_keep_activations(keep)
        record["options"]["keep_activations"] = keep

    def set_resident(resident: int) -> None:
        engine.set_resident_blocks(resident)
        record["options"]["resident_blocks"] = resident

    def note(line: str) -> None:
        record["tuned"].append(line)
        log.info(line)

    trade = "resident_blocks" not in strategy.explicit  # a resident count the user set stays

    return PlanTuner(
        set_keep=set_keep,
        keep=engine.options.keep_activations,
        num_layers=len(engine.layers),
        budget=record["vram_budget_bytes"],
        layer_bytes=max(plan.activation_layer_bytes, 1),
        device=engine.device,
        steps=strategy.tune_steps,
        log=note,
        set_resident=set_resident if trade else None,
        resident=engine.options.resident_blocks,
        num_blocks=engine.num_blocks,
        block_bytes=engine.store.max_block_bytes,
        timings=engine.timings,
        timer=engine.time_steps,
        pays=resident_pays,
    )
