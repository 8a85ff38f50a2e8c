"""The planner: engine options that fit a VRAM budget, chosen from the memory model's estimates.

Torch-free (``poros-lightning check`` prints plans without torch). The strategies call :func:`plan_engine` at
setup; what the first steps then measure is the engine's tuner's (``engine/tuner.py``). The memory model itself
is :mod:`poros_lightning.memory.estimate`; this module re-exports its names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poros_lightning.memory.estimate import HEADROOM, MemoryPlan, budget_for, headroom_for, plan_memory
from poros_lightning.memory.sizes import (
    BF16,
    LORA_BYTES_PER_PARAM,
    QUANTIZATIONS,
    ceil_div,
    format_bytes,
    parse_bytes,
    quantized_weight_bytes,
)

__all__ = [
    "BF16",
    "DEFAULT_LINK_GBPS",
    "EnginePlan",
    "HEADROOM",
    "LAYER_FLOPS",
    "LAYER_FORWARD_S",
    "LORA_BYTES_PER_PARAM",
    "MemoryPlan",
    "QUANTIZATIONS",
    "ceil_div",
    "format_bytes",
    "parse_bytes",
    "plan_engine",
    "plan_memory",
    "quantized_weight_bytes",
    "resident_pays",
]


DEFAULT_LINK_GBPS = 25.0
"""Pinned host-to-device bandwidth the planner assumes when it is not told one: a PCIe 4.0 x16 link, the
consumer cards' (``poros-lightning doctor`` measures it; the H200's Gen5 link gives 55 GB/s)."""
LAYER_FORWARD_S = 4e-3
"""About how long a decoder layer's forward takes to issue: some 100 kernel launches at about 40 us of host time
each (the resident Qwen2.5-72B forward on the H200: 8191 kernels in 0.30-0.53 s, docs/benchmarks/qwen2.5-72b.jsonl).
The floor of :func:`layer_forward_s`: a layer's forward over few tokens waits on the host, not the matmuls."""
LAYER_FLOPS = 280e12
"""Floating-point operations per second of a layer's NF4 linear layers (dequantize, bf16 matmul) over many tokens:
about 280 TFLOP/s on the H100 and H200 (Qwen2.5-32B at seq 2048: 6.7 ms per layer; 7B at 4 x 4 x 2048 tokens:
55.8 ms, docs/benchmarks/planner_sweep.jsonl and recipes.jsonl). A smaller card computes more slowly, so its
copies hide sooner than this assumes; its tuner reads the real time from the second step (engine/tuner.py)."""


def layer_forward_s(plan: MemoryPlan) -> float:
    """About how long one block's forward through its largest layer takes: the launch floor
    (:data:`LAYER_FORWARD_S`) or the matmuls at :data:`LAYER_FLOPS`, whichever is longer.

    A streamed layer whose copy takes longer than this is bound by the link (Note: [link-bound layers]).
    """
    return max(LAYER_FORWARD_S, plan.layer_forward_flops / LAYER_FLOPS)


def resident_pays(
    copy_s: float,
    forward_s: float,
    block_bytes: int,
    layer_bytes: int,
    layers_per_block: float = 1.0,
    recompute_s: float = 0.0,
) -> bool:
    """Whether memory buys more time as resident blocks than as kept activations (Note: [link-bound layers]).

    A kept layer skips its recompute in the backward, for ``layer_bytes``: ``recompute_s``, one layer's
    recompute where it was timed, else one layer forward (``forward_s`` is a block's forward, without waits on
    copies, over ``layers_per_block`` layers). A resident block skips its two copies per step, but saves only
    what of them the block's forward did not hide, at most ``2 * (copy_s - forward_s)``, for ``block_bytes``.
    Per byte, whichever saves more: at Qwen2.5-72B (seq 512, 55 GB/s) a 453 MB block copies in 8.2 ms against
    a 4 ms forward, and resident blocks pay; at 32B a 252 MB block copies in 4.6 ms against a forward of about
    4 ms, and kept layers do. Where the host bounds the backward, a recompute costs more than the forward's
    kernels: at 32B on the H100 a layer computed in 2.6 ms, and each kept layer given up for a resident block
    added 5.4-7.3 ms to the step (planner_sweep.jsonl, run 2026-12-07T15:53:12).
    """
    if layer_bytes <= 0:
        return True
    if block_bytes <= 0:
        return False
    kept = recompute_s if recompute_s > 0 else forward_s / layers_per_block
    return 2 * max(copy_s - forward_s, 0.0) / block_bytes > kept / layer_bytes


@dataclass(frozen=True)
class EnginePlan:
    """Engine options chosen for a VRAM budget, and why.

    Attributes:
        block_size: decoder layers per block.
        prefetch: blocks copied ahead.
        resident_blocks: blocks kept on the device, spread over the model (copied once).
        keep_activations: last decoder layers that keep their activations (no recompute).
        embeddings_on_host: keep the input embedding table in host memory.
        head_on_host: keep the LM head's weight in host memory, copied in for its forward and backward.
        head_copies: head copies per step with ``head_on_host`` (1: the forward's copy serves the backward).
        head_prefetch: with ``head_on_host``, the head's copy runs during the last layers' forwards (``False``:
            when the head runs, so the weight never shares the device with a layer's forward).
        inputs_on_host: each recomputing layer's saved input waits in host memory.
        optimizer_on_host: keep the optimizer's moments in host memory between steps.
        activation_layer_bytes: estimate of one layer's kept activations (what the tuner starts from).
        vram_estimate: estimated peak of the chosen plan (bytes).
        vram_budget: the budget (bytes).
        explanation: one line per decision, for the log.
    """

    block_size: int
    prefetch: int
    resident_blocks: int
    embeddings_on_host: bool
    vram_estimate: int
    vram_budget: int
    explanation: tuple[str, ...]
    head_on_host: bool = False
    optimizer_on_host: bool = False
    keep_activations: int = 0
    head_copies: int = 2
    inputs_on_host: bool = False
    activation_layer_bytes: int = 0
    head_prefetch: bool = True

    def estimate_with(self, keep_activations: int, resident_blocks: int, block_bytes: float) -> float:
        """The estimate (bytes) of this plan with other counts of kept layers and resident blocks (``block_bytes``
        each): what the tuner's variants of the plan cost by the same model."""
        kept = (keep_activations - self.keep_activations) * self.activation_layer_bytes
        return self.vram_estimate + kept + (resident_blocks - self.resident_blocks) * block_bytes

    def options(self) -> dict[str, Any]:
        """Every option the plan chooses (:data:`poros_lightning.memory.options.OPTIONS` marks them ``planned``)."""
        return {**self.engine_kwargs(), "optimizer_on_host": self.optimizer_on_host}

    def engine_kwargs(self) -> dict[str, Any]:
        """The options ``prepare`` takes (``optimizer_on_host`` belongs to the precision plugin)."""
        return {
            "block_size": self.block_size,
            "prefetch": self.prefetch,
            "resident_blocks": self.resident_blocks,
            "keep_activations": self.keep_activations,
            "embeddings_on_host": self.embeddings_on_host,
            "head_on_host": self.head_on_host,
            "head_copies": self.head_copies,
            "head_prefetch": self.head_prefetch,
            "inputs_on_host": self.inputs_on_host,
        }


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    return cfg.get("text_config") or cfg


CHUNK_HINT_TOKENS = 512
"""Chunk size a refusal prices the chunked loss at (``LoRALightningModule(loss_chunk_tokens=512)``): with more tokens
per micro-batch than this, a refused plan's hint names the chunked loss and the budget it needs."""


def _chunked_hint(cfg: Mapping[str, Any], **planning: Any) -> str:
    """The refusal hint's last clause: the chunked loss, and the smallest budget the planner names with it."""
    from poros_lightning.errors import PorosOOMError

    try:
        plan_engine(cfg, 1, **planning, keep_activations=False, loss_chunk_tokens=CHUNK_HINT_TOKENS)
    except PorosOOMError as err:
        needs = f", which needs vram_budget >= {format_bytes(err.needed_bytes)}" if err.needed_bytes else ""
    else:  # pragma: no cover - nothing to plan for
        needs = ""
    return f", or compute the LM head and the loss in chunks (LoRALightningModule(loss_chunk_tokens={CHUNK_HINT_TOKENS}){needs})."


def plan_engine(
    cfg: Mapping[str, Any],
    vram_budget: int | str,
    *,
    seq_len: int = 512,
    batch_size: int = 1,
    lora_r: int = 16,
    quantization: str = "nf4-dq",
    lora_targets: Sequence[str] | None = None,
    head_frozen: bool = True,
    keep_activations: bool = True,
    link_gbps: float | None = None,
    loss_chunk_tokens: int | None = None,
    micro_batches: int = 1,
    workspace_bytes: int | None = None,
) -> EnginePlan:
    """Choose engine options that fit ``vram_budget`` (estimates from :func:`plan_memory`).

    The smallest plan streams one layer per block through two slots. If that does not fit, the
    minimum-memory options turn on one by one, each exact, in order of copies per byte saved: the input
    embeddings move to host memory (untied models; no copies but the activations), the optimizer's two
    moments wait in host memory between steps (two copies of them per step, about two bytes copied per
    byte saved, both on side streams; the backward's last quarter and the update then need the adapter,
    its gradient and the moments, with little of the forward alive), and the LM head's weight moves to host memory (untied, frozen heads; two head copies
    per step, two or more bytes copied per byte saved: the weight and the fp32 logits are then never on
    the device together, which saves ``min(head, 8 bytes x tokens x vocabulary)``); last, each recomputing layer's
    input (one hidden state per layer) waits in host memory (copied out in the link's idle direction and back
    in the backward's idle link time). ``head_frozen=False`` (a head trained through ``modules_to_save``) rules
    the head out. With a chunked loss (``loss_chunk_tokens``) every chunk's logits need the weight: it sits
    beside them, so the head in host memory saves ``min(head, the activations other than the layers' inputs and
    the logits)``, and its forward's copy serves its backward at no cost (``head_copies=1``).

    With the head in host memory, its backward's copy is the one copy nothing hides. When the budget (less
    10% headroom) also holds the head beside the logits, the plan keeps the forward's copy for the backward
    (``head_copies=1``, one head copy per step). It does not move the layers' inputs out to make room: on the
    H200 that costs the step more than the head's copy saves (docs/benchmarks.md).

    Memory left over (10% of the budget is kept as headroom) buys either of two things. Resident blocks (spread
    over the model, copied once: two copies fewer each per step) pay where the link bounds the step; kept
    activations (``keep_activations``: the last layers skip their recompute, one layer forward fewer each per
    step) pay where compute or kernel launches bound it. When, per byte, a block's copy at ``link_gbps``
    (default :data:`DEFAULT_LINK_GBPS`) left unhidden by a layer's forward (:func:`layer_forward_s`) costs more
    than the forward a kept layer skips (:func:`resident_pays`), the layers are link-bound and resident blocks
    come first, kept activations from what is left; otherwise kept activations come first, resident blocks from
    what is left (every layer kept, or less than one more layer's activations). ``keep_activations=False``, and
    models whose layers share keys and values (which cannot keep them), spend it all on resident blocks.

    Note: [link-bound layers]
        At Qwen2.5-72B on the H200 (seq 512), a 453 MB block takes 8.2 ms to copy at 55 GB/s, twice a layer's
        forward: the streamed forward waits on copies whatever else is on the device. With 24 GB, 22 spread
        resident blocks ran at 1.10x a resident step, while the same memory spent on 31 layers' kept
        activations ran at 1.33x (docs/benchmarks.md, "72B: where the time goes"). At 32B a 252 MB block copies
        in 4.6 ms, about a layer's forward: the copies are hidden, and on the H100 every trade of kept layers
        for resident blocks ran slower while the fastest plans kept the most layers (planner_sweep.jsonl, the
        32B seq 512 rows of 2026-12-07). A block copied just longer than a forward is not worth a kept layer's
        bytes: only the part of its copies the forward leaves exposed is saved, so the comparison is per byte
        of what each saves (:func:`resident_pays`), not copy against forward. At 7B a block copies in 2.3 ms
        and kept activations remain the better use.
    Larger blocks are not chosen: a layer per block already hides copies behind compute, and smaller slots
    leave more room for the rest.

    Raises:
        PorosOOMError: even the smallest plan does not fit; the message gives the smallest budget that would.
    """
    from poros_lightning.errors import PorosOOMError

    budget = parse_bytes(vram_budget)
    plan = plan_memory(
        cfg, seq_len=seq_len, batch_size=batch_size, lora_r=lora_r, block_size=1, quantization=quantization,
        prefetch=1, lora_targets=lora_targets, loss_chunk_tokens=loss_chunk_tokens, micro_batches=micro_batches,
        workspace_bytes=workspace_bytes,
    )  # fmt: skip
    usable = budget - headroom_for(budget, plan.logits_bytes, plan.dequant_bytes)  # Note: [headroom]
    text = _text_config(cfg)
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    table = int(text["vocab_size"]) * int(text["hidden_size"]) * BF16
    tokens = batch_size * micro_batches * seq_len  # block-major: every micro-batch's inputs and logits at once
    moments = plan.lora_params * 8  # AdamW's exp_avg and exp_avg_sq, fp32
    slots = plan.slots * plan.per_block_bytes
    # The forward/backward peak, and the optimizer update's peak once the moments live on the host:
    # adapter + gradient + moments + one fp32 temporary as large as a moment (AdamW's sqrt), the slots,
    # and whatever of the resident part stays on the device.
    fwd = plan.streamed_vram_min
    why = [f"host-side options off (block_size 1, 2 x {format_bytes(plan.per_block_bytes)} slots): {format_bytes(fwd)}"]
    if loss_chunk_tokens is not None:
        why.insert(
            0, f"LM head and loss in chunks of {loss_chunk_tokens} tokens: logits {format_bytes(plan.logits_bytes)}"
        )
    embed_host = head_host = opt_host = inputs_host = False
    resident_left = plan.resident_bytes + plan.workspace_bytes  # what stays on the device in every phase
    # Sample-major, the moments come in during the backward's last quarter (Note: [when the state moves]), beside
    # the adapter, its gradient, one layer's recompute and backward, and the inputs of the layers still to
    # recompute; block-major, after the backward (its last quarter also holds every micro-batch's gradients).
    tail_lora = plan.lora_bytes if micro_batches == 1 else plan.lora_bytes - moments

    def need() -> int:
        update = resident_left + slots + plan.lora_bytes + plan.lora_params * 4
        inputs_left = (2 if inputs_host else -(-plan.num_layers // 4)) * plan.boundary_bytes
        tail = resident_left + slots + tail_lora + plan.recompute_layer_bytes + plan.backward_extra_bytes + inputs_left
        return max(fwd, update, tail) if opt_host else fwd

    if need() > usable and not tied:
        embed_host = True
        fwd -= table
        resident_left -= table
        why.append(f"input embeddings in host memory saves {format_bytes(table)}: {format_bytes(need())}")
    if need() > usable and moments:
        opt_host = True
        fwd -= moments
        why.append(
            f"optimizer moments in host memory (two copies of {format_bytes(moments)} per step): {format_bytes(need())}"
        )
    vocab = int(text["vocab_size"])
    if loss_chunk_tokens is None:
        head_saves = min(table, 8 * tokens * vocab)
    else:
        # Every chunk needs the weight: it sits beside the chunks' logits and the head's input and its gradient
        # (two hidden states), and is away only from a layer's forward or recompute and the dequantized weight,
        # provided its copy waits for the head (head_prefetch below).
        hidden_state = tokens * int(text["hidden_size"]) * BF16
        inputs_and_logits = plan.num_layers * hidden_state + plan.logits_bytes
        head_saves = min(table, plan.activation_streamed_bytes - inputs_and_logits - 2 * hidden_state)
    if need() > usable and not tied and head_frozen:
        head_host = True
        fwd -= head_saves
        resident_left -= table
        why.append(
            f"LM head in host memory (two head copies per step) saves {format_bytes(head_saves)}: {format_bytes(need())}"
        )
    inputs = plan.num_layers * tokens * int(text["hidden_size"]) * BF16  # one saved hidden state per layer
    if need() > usable:
        inputs_host = True
        fwd -= inputs
        why.append(
            f"layer inputs in host memory (two copies of {format_bytes(inputs)} per step): {format_bytes(need())}"
        )
    head_copies = 2
    if head_host and loss_chunk_tokens is not None:
        head_copies = 1  # the weight is beside the chunks' logits anyway: keeping it for their backward is free
        why.append("the head's forward copy serves its backward (one head copy per step; free with a chunked loss)")
    elif head_host:
        saved_fwd = fwd
        fwd += min(table, 8 * tokens * vocab)
        if need() <= usable:
            head_copies = 1
            why.append(f"the head's forward copy serves its backward (one head copy per step): {format_bytes(need())}")
        else:
            fwd = saved_fwd
    head_prefetch = True
    if head_host and loss_chunk_tokens is not None:
        # Copied during the last layers' forwards, the weight would sit beside a layer's forward and a dequantized
        # weight, the very memory it was counted away from: that copy waits for the head unless both fit.
        fwd += head_saves  # spread over the last layers' forwards, the copy sits beside one of them
        if need() > usable:
            head_prefetch = False
            fwd -= head_saves
            why.append("the head's copy waits for the head (not beside the last layers' forwards, not hidden)")
    total = need()
    if total > usable:
        smallest = budget_for(total, plan.logits_bytes, plan.dequant_bytes)
        kept_back = headroom_for(smallest, plan.logits_bytes, plan.dequant_bytes)
        chunked = "."
        if loss_chunk_tokens is None and seq_len * batch_size > CHUNK_HINT_TOKENS:
            chunked = _chunked_hint(
                cfg, seq_len=seq_len, batch_size=batch_size, lora_r=lora_r, quantization=quantization,
                lora_targets=lora_targets, head_frozen=head_frozen, micro_batches=micro_batches,
                workspace_bytes=workspace_bytes,
            )  # fmt: skip
        raise PorosOOMError(
            f"The smallest streamed plan needs about {format_bytes(total)} of GPU memory at seq_len {seq_len}, "
            f"batch {batch_size}{f' x {micro_batches} block-major micro-batches' if micro_batches > 1 else ''}, "
            f"LoRA r{lora_r}, and leaves {format_bytes(kept_back)} of the budget to "
            "the allocator: "
            f"{format_bytes(smallest)}; the budget is {format_bytes(budget)}.",
            f"Use vram_budget >= {format_bytes(smallest)}, or a shorter seq_len / smaller batch / lower LoRA rank"
            + chunked,
            needed_bytes=smallest,
        )
    spare = usable - total  # Note: [headroom]
    kept = 0
    if int(text.get("num_kv_shared_layers") or 0):
        keep_activations = False  # refused by prepare(): a later layer's backward reads an earlier layer's K/V
    gbps = float(link_gbps) if link_gbps else DEFAULT_LINK_GBPS
    copy_s = plan.per_block_bytes / (gbps * 1e9)
    forward_s = layer_forward_s(plan)
    link_bound = resident_pays(copy_s, forward_s, plan.per_block_bytes, plan.activation_layer_bytes)
    resident = 0
    if keep_activations and spare > 0:
        why.append(
            f"a block copies in {copy_s * 1e3:.1f} ms at {gbps:.1f} GB/s, "
            + (
                f"against a layer's forward of about {forward_s * 1e3:.0f} ms: per byte, resident blocks save "
                "more than kept activations: resident blocks first"
                if link_bound
                else f"against a layer's forward of about {forward_s * 1e3:.0f} ms: per byte, kept activations "
                "save more than resident blocks: kept activations first"
            )
        )

    def resident_fitting() -> int:
        """Blocks that ``spare`` keeps resident (every block but the ring's two at most); logs them."""
        n = max(int(min(plan.num_blocks - 2, spare // plan.per_block_bytes)), 0) if plan.per_block_bytes else 0
        if n:
            why.append(
                f"{n} of {plan.num_blocks} blocks stay resident, spread over the model (copied once): "
                f"{format_bytes(need() + n * plan.per_block_bytes)}"
            )
        return n

    if link_bound and keep_activations and spare > 0:
        resident = resident_fitting()
        spare -= resident * plan.per_block_bytes
    if keep_activations and plan.activation_layer_bytes and spare > 0:
        kept = min(plan.num_layers, spare // plan.activation_layer_bytes)
        spare -= kept * plan.activation_layer_bytes
        fwd += kept * plan.activation_layer_bytes
        total = need()
        if kept:
            why.append(
                f"the last {kept} of {plan.num_layers} layers keep their activations (no recompute, "
                f"{format_bytes(plan.activation_layer_bytes)} each): {format_bytes(total + resident * plan.per_block_bytes)}"
            )
    if not resident and spare > 0:
        resident = resident_fitting()
    total += resident * plan.per_block_bytes
    why.append(f"budget {format_bytes(budget)}, estimated peak {format_bytes(total)}")
    return EnginePlan(
        1,
        1,
        resident,
        embed_host,
        total,
        budget,
        tuple(why),
        head_host,
        opt_host,
        keep_activations=int(kept),
        head_copies=head_copies,
        inputs_on_host=inputs_host,
        activation_layer_bytes=plan.activation_layer_bytes,
        head_prefetch=head_prefetch,
    )
