"""``poros-lightning check MODEL``: is this model supported, and how much memory does its QLoRA run need?

Invariant: checking never imports torch or transformers and never needs the network. MODEL is resolved, in
order, as a local directory or ``config.json``, the local Hugging Face cache, the config facts bundled for
well-known checkpoints, and — only when online and ``huggingface_hub`` is installed — a download of that one
``config.json`` with a short timeout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from poros_lightning.arch import (
    DOC_LINK,
    ArchSpec,
    UnlistedArchitectureWarning,
    arch_for_config,
    transformers_knows,
)
from poros_lightning.errors import PorosConfigError, PorosOOMError, UnsupportedArchitectureError
from poros_lightning.memory.budget import minimum_budget
from poros_lightning.memory.planner import (
    QUANTIZATIONS,
    MemoryPlan,
    format_bytes,
    parse_bytes,
    plan_engine,
    plan_memory,
)
from poros_lightning.tools.model_config import load_config

__all__ = ["CheckResult", "check", "format_check", "load_config", "main"]

EXIT_SUPPORTED = 0
EXIT_ERROR = 1
EXIT_UNSUPPORTED = 2


@dataclass(frozen=True)
class CheckResult:
    """What ``check`` found out about a model.

    Attributes:
        model: the MODEL argument as given.
        source: where the config came from (a path, the HF cache, bundled facts, or the Hub).
        model_type: the config's ``model_type``.
        supported: whether poros-lightning streams this model (status certified or experimental).
        spec: the registry entry, when supported.
        error: why it is not supported (problem and HINT), when not.
        max_position_embeddings: the model's context length, when the config states it.
        plan: the memory plan, when supported.
        notes: remarks about the model, the layout or the estimate.
        engine_plan: with a VRAM budget, what ``PorosStrategy(vram_budget=...)`` would choose (one line
            per decision), or why nothing fits.
        engine_options: with a VRAM budget that fits, the options that plan gives the engine
            (``EnginePlan.engine_kwargs()``) and ``optimizer_on_host``.
        minimum_budget: the smallest VRAM budget ``PorosStrategy(vram_budget=...)`` accepts, every host-side
            option on (:func:`~poros_lightning.memory.budget.minimum_budget`), in bytes.
    """

    model: str
    source: str
    model_type: str
    supported: bool
    spec: ArchSpec | None = None
    error: str | None = None
    max_position_embeddings: int | None = None
    plan: MemoryPlan | None = None
    notes: tuple[str, ...] = ()
    engine_plan: tuple[str, ...] = ()
    engine_options: dict[str, Any] | None = None
    minimum_budget: int | None = None

    @property
    def family(self) -> str | None:
        return self.spec.family if self.spec else None

    @property
    def status(self) -> str | None:
        return self.spec.status if self.spec else None

    @property
    def guarantee(self) -> str | None:
        return self.spec.guarantee if self.spec else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (used by ``--json``)."""
        out = dataclasses.asdict(self)
        gate = self.spec.gate if self.spec else None
        out.update(
            family=self.family,
            status=self.status,
            guarantee=self.guarantee,
            certified_scale=gate.scale if gate else None,
        )
        return out


def check(
    model: str,
    *,
    seq_len: int = 512,
    lora_r: int = 16,
    block_size: int = 1,
    vram_budget: int | str | None = None,
    batch_size: int = 1,
    quantization: str = "nf4-dq",
    prefetch: int = 1,
    allow_unlisted: bool = False,
    link_gbps: float | None = None,
    loss_chunk_tokens: int | None = None,
    micro_batches: int = 1,
) -> CheckResult:
    """Check MODEL's support status and plan its memory (see :func:`poros_lightning.memory.planner.plan_memory`).

    Args:
        model: a local model directory, a ``config.json`` path, or a hub id.
        seq_len: tokens per sequence for the plan.
        lora_r: LoRA rank for the plan.
        block_size: decoder layers per streamed block.
        vram_budget: a GPU budget (bytes or ``"8GB"``) to test the plan against.
        batch_size: sequences per micro-batch.
        quantization: ``nf4-dq`` (default), ``nf4``, ``fp4`` or ``none``.
        prefetch: blocks copied ahead of the one computing.
        allow_unlisted: treat an unregistered model type as experimental with a guessed layout.
        link_gbps: the pinned host-to-device bandwidth the planner plans for (``doctor`` measures it;
            default :data:`~poros_lightning.memory.planner.DEFAULT_LINK_GBPS`).
        loss_chunk_tokens: the LM head and the loss in chunks of this many tokens
            (``LoRALightningModule(loss_chunk_tokens=...)``); None: unchunked.
        micro_batches: ``k`` block-major micro-batches of ``batch_size`` per step (``PorosStrategy(micro_batches=k)``).

    Returns:
        The result; an unsupported model gives ``supported=False`` and the reason in ``error``.

    Raises:
        PorosConfigError: MODEL cannot be resolved, or a planning argument is out of range.
    """
    cfg, source = load_config(model)
    model_type = str(cfg.get("model_type") or "")
    text = cfg.get("text_config") or cfg
    max_pos = text.get("max_position_embeddings") or cfg.get("max_position_embeddings")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnlistedArchitectureWarning)
            spec = arch_for_config(cfg, allow_unlisted=allow_unlisted)
    except UnsupportedArchitectureError as err:
        return CheckResult(
            model, source, model_type or "<missing>", False, error=str(err), max_position_embeddings=max_pos
        )
    notes = [str(w.message) for w in caught if issubclass(w.category, UnlistedArchitectureWarning)]
    if spec.notes and not spec.guessed:
        notes.append(spec.notes)
    if transformers_knows(model_type) is None:
        notes.append("transformers is not installed here: install it before training.")
    plan = plan_memory(
        cfg,
        seq_len=seq_len,
        batch_size=batch_size,
        lora_r=lora_r,
        block_size=block_size,
        quantization=quantization,
        prefetch=prefetch,
        vram_budget=vram_budget,
        lora_targets=spec.lora_targets,
        loss_chunk_tokens=loss_chunk_tokens,
        micro_batches=micro_batches,
    )
    notes.extend(plan.notes)
    # The strategy's own call (PorosStrategy._plan): the same arguments, the planner's defaults for the rest.
    planning = dict(seq_len=seq_len, batch_size=batch_size, lora_r=lora_r, quantization=quantization)
    planning.update(loss_chunk_tokens=loss_chunk_tokens, micro_batches=micro_batches)
    smallest = minimum_budget(cfg, **planning, lora_targets=spec.lora_targets)
    engine_plan: tuple[str, ...] = ()
    engine_options = None
    if vram_budget is not None:
        try:
            chosen = plan_engine(cfg, vram_budget, **planning, lora_targets=spec.lora_targets, link_gbps=link_gbps)
        except PorosOOMError as err:
            engine_plan = (err.problem, *((f"fix: {err.hint}",) if err.hint else ()))
        else:
            engine_plan = chosen.explanation
            engine_options = {**chosen.engine_kwargs(), "optimizer_on_host": chosen.optimizer_on_host}
    return CheckResult(
        model, source, model_type, True, spec, None, max_pos, plan, tuple(notes), engine_plan, engine_options, smallest
    )


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B ({n:,})" if n >= 10**9 else f"{n / 1e6:.1f} M ({n:,})"


_ON = "host-side options on"


def _budget_lines(plan: MemoryPlan, smallest: int | None) -> list[str]:
    if plan.vram_budget is None:
        return []
    budget = format_bytes(plan.vram_budget)
    lines = []
    if smallest is not None and smallest <= plan.vram_budget:
        lines.append(f"VRAM budget {budget}: fits (the smallest budget that does: {format_bytes(smallest)}, {_ON})")
    elif smallest is not None:
        lines.append(
            f"VRAM budget {budget}: does NOT fit; the smallest budget that would is {format_bytes(smallest)} ({_ON})"
        )
    needs = format_bytes(plan.streamed_vram_min)
    if plan.fits:
        line = f"streamed, host-side options off: fits at block_size {plan.block_size} (needs {needs})"
        if plan.max_block_size and plan.max_block_size > plan.block_size:
            line += f"; block_size up to {plan.max_block_size} fits"
    else:
        line = f"streamed, host-side options off: does not fit at block_size {plan.block_size} (needs {needs})"
        if plan.max_block_size:
            line += f"; block_size {plan.max_block_size} fits {budget}"
    resident = "fits" if plan.resident_fits else "does not fit"
    return [
        *lines,
        f"  {line}",
        f"  a resident run with gradient checkpointing {resident} ({format_bytes(plan.resident_vram_gc)})",
    ]


def format_check(result: CheckResult) -> str:
    """Plain-text report of a :class:`CheckResult`."""
    lines = [
        f"model           {result.model}",
        f"config from     {result.source}",
        f"model_type      {result.model_type}",
    ]
    if result.max_position_embeddings:
        lines.append(f"context         {result.max_position_embeddings:,} tokens")
    if not result.supported:
        lines += ["status          unsupported", "", f"error: {result.error}"]
        return "\n".join(lines)
    spec, plan = result.spec, result.plan
    assert spec is not None and plan is not None
    lines += [
        f"family          {spec.family}",
        f"status          {spec.status}"
        + (f" up to {spec.gate.scale} ({spec.gate.model})" if spec.gate else "")
        + (" (layout guessed)" if spec.guessed else ""),
        f"guarantee       {spec.guarantee}",
        f"parameters      {_params(plan.params_total)}",
        f"LoRA            r={plan.lora_r} on {', '.join(spec.lora_targets)}: {plan.lora_params:,} parameters",
        "",
        f"memory plan     seq_len {plan.seq_len}, batch {plan.batch_size}"
        + (f" x {plan.micro_batches} block-major micro-batches" if plan.micro_batches > 1 else "")
        + f", {plan.quantization}, block_size "
        f"{plan.block_size} ({plan.num_blocks} blocks of {plan.num_layers} layers), prefetch {plan.prefetch}",
        f"  NF4 base (decoder linear weights)        {format_bytes(plan.nf4_base_bytes):>10}",
        f"  per block (one GPU slot, {plan.slots} slots)      {format_bytes(plan.per_block_bytes):>10}",
        f"  resident (embeddings, norms, head, ...)  {format_bytes(plan.resident_bytes):>10}",
        f"  LoRA (fp32 weights, grads, Adam)         {format_bytes(plan.lora_bytes):>10}",
        f"  logits (bf16, fp32 upcast and grad)      {format_bytes(plan.logits_bytes):>10}"
        + (f" (loss in chunks of {plan.loss_chunk_tokens} tokens)" if plan.loss_chunk_tokens else ""),
        f"  cuBLAS workspaces (forward, backward)    {format_bytes(plan.workspace_bytes):>10}",
        "",
        f"  {'estimate':<22}{'streamed':>12}{'resident+GC':>14}{'resident':>12}",
        f"  {'activations':<22}{format_bytes(plan.activation_streamed_bytes):>12}"
        f"{format_bytes(plan.activation_resident_gc_bytes):>14}{format_bytes(plan.activation_resident_bytes):>12}",
        f"  {'VRAM, host-side off':<22}{format_bytes(plan.streamed_vram_min):>12}"
        f"{format_bytes(plan.resident_vram_gc):>14}{format_bytes(plan.resident_vram):>12}",
        f"  host RAM (streamed)   {format_bytes(plan.host_ram_streamed)} (pinned NF4 base + resident copy while loading)",
        "  VRAM figures count tensors only (no CUDA context); activations are estimates.",
    ]
    if result.minimum_budget is not None:
        lines.append(
            f"  smallest budget       {format_bytes(result.minimum_budget)} (host-side options on: input embeddings, "
            "optimizer state, LM head, layer inputs)"
        )
    budget = _budget_lines(plan, result.minimum_budget)
    if budget:
        lines += ["", *budget]
    if result.engine_plan:
        lines += ["", "planner (PorosStrategy(vram_budget=...), minimum-memory options included):"]
        lines += [f"  {line}" for line in result.engine_plan]
        if result.engine_options is not None:
            lines.append("  options: " + " ".join(f"{k}={v}" for k, v in result.engine_options.items()))
    if result.notes:
        lines += ["", *(f"note: {note}" for note in result.notes)]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poros-lightning check",
        description="Report whether MODEL is supported and plan its QLoRA memory, streamed vs resident. "
        "Needs neither torch nor a GPU nor the network.",
        epilog=f"Exit status: 0 supported, 2 unsupported, 1 other errors. Supported families: {DOC_LINK}.",
    )
    parser.add_argument("model", help="model directory, config.json, or hub id (e.g. Qwen/Qwen2.5-7B-Instruct)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: 512)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch (default: 1)")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default: 16)")
    parser.add_argument("--block-size", type=int, default=1, help="decoder layers per streamed block (default: 1)")
    parser.add_argument("--prefetch", type=int, default=1, help="blocks copied ahead (default: 1)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="nf4-dq", help="base quantization")
    parser.add_argument("--vram-budget", help="GPU memory to plan for, e.g. 8GB, 24GiB")
    parser.add_argument(
        "--link-gbps",
        type=float,
        help="pinned host-to-device GB/s to plan for (`poros-lightning doctor` measures it; default 25, PCIe 4.0 x16)",
    )
    parser.add_argument(
        "--loss-chunk-tokens",
        type=int,
        help="plan for the LM head and loss in chunks of N tokens (LoRALightningModule(loss_chunk_tokens=N))",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="plan for K block-major micro-batches of --batch-size per step (PorosStrategy(micro_batches=K))",
    )
    parser.add_argument("--allow-unlisted", action="store_true", help="try an unregistered model type (guessed layout)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``poros-lightning check``; returns the exit status (0 supported, 2 unsupported, 1 error)."""
    args = _parser().parse_args(argv)
    try:
        budget = parse_bytes(args.vram_budget) if args.vram_budget is not None else None
        result = check(
            args.model,
            seq_len=args.seq_len,
            lora_r=args.lora_r,
            block_size=args.block_size,
            vram_budget=budget,
            batch_size=args.batch_size,
            quantization=args.quantization,
            prefetch=args.prefetch,
            allow_unlisted=args.allow_unlisted,
            link_gbps=args.link_gbps,
            loss_chunk_tokens=args.loss_chunk_tokens,
            micro_batches=args.micro_batches,
        )
    except PorosConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_check(result))
    return EXIT_SUPPORTED if result.supported else EXIT_UNSUPPORTED


if __name__ == "__main__":
    sys.exit(main())
