"""Memory planner: what a QLoRA run of a model needs on the GPU and in host RAM, streamed or resident.

Pure arithmetic over an HF config dict — no torch — so ``poros-lightning check`` answers on any machine,
and the strategy can size its plan before it allocates anything.

Invariant: the byte counts of *stored* tensors are exact for the registered families: parameter counts
match the model transformers builds, and quantized sizes follow bitsandbytes' storage layout (4-bit codes
packed two per byte, one absmax per block of 64 weights; with double quantization the absmax are 8-bit codes
with one fp32 absmax per 256 of them plus one fp32 offset). Activation figures are *estimates* of what the
autograd graph keeps; they assume a fused attention kernel (no T×T score matrix) and count tensors only, not
the CUDA context or allocator fragmentation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poros_lightning.arch.registry import STANDARD_TARGETS, registered
from poros_lightning.arch.shapes import LayerShape, ModelShapes, model_shapes
from poros_lightning.errors import PorosConfigError

__all__ = ["QUANTIZATIONS", "MemoryPlan", "format_bytes", "parse_bytes", "plan_memory", "quantized_weight_bytes"]

QUANTIZATIONS = ("nf4-dq", "nf4", "fp4", "none")

_BLOCKSIZE = 64  # bitsandbytes 4-bit quantization block
_NESTED_BLOCKSIZE = 256  # blocks of the double-quantized absmax
_BF16 = 2
_LORA_BYTES_PER_PARAM = 4 + 4 + 8  # fp32 weight, fp32 gradient, two fp32 Adam moments
DEFAULT_LINK_GBPS = 25.0
"""Pinned host-to-device bandwidth the planner assumes when it is not told one: a PCIe 4.0 x16 link, the
consumer cards' (``poros-lightning doctor`` measures it; the H200's Gen5 link gives 55 GB/s)."""
LAYER_FORWARD_S = 4e-3
"""About how long a decoder layer's forward takes to issue: some 100 kernel launches at about 40 us of host time
each (the resident Qwen2.5-72B forward on the H200: 8191 kernels in 0.30-0.53 s, docs/benchmarks/qwen2.5-72b.jsonl).
A streamed layer whose copy takes longer than this is bound by the link (Note: [link-bound layers])."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int) -> int:
    """Parse a size: an int (bytes) or a string such as ``"8GB"`` (8e9), ``"8GiB"`` (8·2**30), ``"512MB"``.

    Decimal units (kB, MB, GB, TB; the bare letters K, M, G, T alike) are powers of 1000; binary units (KiB,
    MiB, GiB, TiB) powers of 1024. Case is ignored.

    Raises:
        PorosConfigError: the value is negative or not a size.
    """
    if isinstance(value, bool):
        raise PorosConfigError(f"invalid size {value!r}.", hint="give bytes as an int, or a string like '8GB'.")
    if isinstance(value, int):
        if value < 0:
            raise PorosConfigError(f"invalid size {value!r}: negative.", hint="give a positive size like '8GB'.")
        return value
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise PorosConfigError(
            f"invalid size {value!r}.",
            hint="write a number with a unit: '8GB' (10^9 bytes), '8GiB' (2^30 bytes), '512MB', or plain bytes.",
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """Human-readable decimal size: ``7.24 GB``."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quantized_weight_bytes(numel: int, quantization: str = "nf4-dq") -> int:
    """Bytes bitsandbytes stores for one linear weight of ``numel`` elements (the shared code tables aside).

    ``nf4-dq``: packed codes ``ceil(n/2)`` + uint8 absmax ``ceil(n/64)`` + fp32 nested absmax
    ``4·ceil(ceil(n/64)/256)`` + a 4-byte fp32 offset (≈ 4.127 bits per weight). ``nf4`` and ``fp4``: packed
    codes + fp32 absmax ``4·ceil(n/64)`` (4.5 bits). ``none``: bf16, 2 bytes per weight.
    """
    if quantization == "none":
        return _BF16 * numel
    packed = _ceil_div(numel, 2)
    blocks = _ceil_div(numel, _BLOCKSIZE)
    if quantization == "nf4-dq":
        return packed + blocks + 4 * _ceil_div(blocks, _NESTED_BLOCKSIZE) + 4
    if quantization in ("nf4", "fp4"):
        return packed + 4 * blocks
    raise PorosConfigError(f"unknown quantization {quantization!r}.", hint=f"use one of {', '.join(QUANTIZATIONS)}.")


@dataclass(frozen=True)
class MemoryPlan:
    """Memory needed by a QLoRA step, streamed vs resident. All sizes are bytes.

    Stored sizes (``nf4_base_bytes``, ``per_block_bytes``, ``resident_bytes``, ``lora_bytes``) are exact for
    registered families; ``activation_*`` and the totals built on them are estimates.

    Attributes:
        params_total: parameters of the model as ``AutoModelForCausalLM`` builds it.
        nf4_base_bytes: the decoder layers' linear weights, quantized (the part that streams).
        per_block_bytes: the largest block of ``block_size`` consecutive layers, quantized (one GPU slot).
        resident_bytes: what stays on the GPU in bf16: embeddings, final norm, LM head (tied embeddings
            counted once), the layers' norms and biases, and modules outside the layers (quantized linears).
        lora_params: LoRA parameters on the default targets.
        lora_bytes: LoRA weights, gradients and two Adam moments, all fp32.
        activation_streamed_bytes: estimate: each block's input, one block's recompute working set, the
            dequantized weight in flight, the boundary gradients, and the logits (bf16, fp32 upcast, fp32 grad).
        activation_resident_bytes: estimate for a resident run without gradient checkpointing.
        activation_resident_gc_bytes: estimate for a resident run with per-layer gradient checkpointing.
        activation_layer_bytes: estimate: what the largest decoder layer saves when it keeps its activations
            (``keep_activations``) instead of recomputing them.
        streamed_vram_min: resident + LoRA + ``slots`` block slots + streamed activations.
        resident_vram: NF4 base + resident + LoRA + activations without checkpointing.
        resident_vram_gc: the same with gradient checkpointing.
        host_ram_streamed: pinned NF4 base + a host copy of the resident modules while loading + one layer in
            bf16 while it is quantized.
        vram_budget: the budget asked about, if any.
        fits: whether the streamed run fits ``vram_budget``.
        resident_fits: whether a resident run with gradient checkpointing fits ``vram_budget``.
        min_budget: the smallest budget the streamed run needs at this ``block_size`` (``streamed_vram_min``).
        max_block_size: the largest ``block_size`` whose streamed run fits ``vram_budget`` (None: none fits).
        notes: what the estimate leaves out for this model.
    """

    model_type: str
    seq_len: int
    batch_size: int
    lora_r: int
    block_size: int
    prefetch: int
    quantization: str
    num_layers: int
    num_blocks: int
    slots: int
    params_total: int
    nf4_base_bytes: int
    per_block_bytes: int
    resident_bytes: int
    lora_params: int
    lora_bytes: int
    activation_streamed_bytes: int
    activation_resident_bytes: int
    activation_resident_gc_bytes: int
    streamed_vram_min: int
    resident_vram: int
    resident_vram_gc: int
    host_ram_streamed: int
    vram_budget: int | None = None
    fits: bool | None = None
    resident_fits: bool | None = None
    min_budget: int | None = None
    max_block_size: int | None = None
    notes: tuple[str, ...] = ()
    activation_layer_bytes: int = 0


def _layer_activation_per_token(layer: LayerShape, targets: frozenset[str], hidden: int) -> int:
    """Estimated bytes one token leaves saved in one decoder layer's autograd graph (LoRA over a frozen base).

    A frozen (4-bit or bf16) matmul saves nothing of its input: only the weight is needed for the input
    gradient. PEFT's LoRA path saves an fp32 copy of each adapted linear's input (the adapters compute in
    fp32). The gated MLP saves three bf16 tensors as wide as the widest projection (the activation's input
    and output, the up projection); attention saves its queries, keys and values (repeated to the query
    heads) and its output, about four bf16 hidden widths; the two RMSNorms save their fp32 inputs. At
    Qwen2.5-7B, seq 512, this gives 170 MB per layer; the H200 measured 162 MB (``keep_activations`` rows of
    docs/benchmarks/qwen2.5-7b.jsonl).
    """
    adapted_in = sum(lin.in_features for lin in layer.linears if lin.name in targets)
    widest = max(lin.out_features for lin in layer.linears)
    return 4 * adapted_in + 3 * _BF16 * widest + 4 * _BF16 * hidden + 2 * 4 * hidden


def _default_targets(model_type: str) -> tuple[str, ...]:
    spec = registered(include_unavailable=True).get(model_type)
    return spec.lora_targets if spec else STANDARD_TARGETS


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PorosConfigError(f"{name}={value!r} must be a positive integer.", hint=f"pass {name} >= 1.")


def plan_memory(
    cfg: Mapping[str, Any] | ModelShapes,
    *,
    seq_len: int = 512,
    batch_size: int = 1,
    lora_r: int = 16,
    block_size: int = 1,
    quantization: str = "nf4-dq",
    prefetch: int = 1,
    vram_budget: int | str | None = None,
    lora_targets: Sequence[str] | None = None,
) -> MemoryPlan:
    """Plan the memory of one QLoRA training step for the model described by ``cfg``.

    Args:
        cfg: an HF config dict (``config.json`` contents, with ``model_type``) or precomputed shapes.
        seq_len: tokens per sequence.
        batch_size: sequences per micro-batch.
        lora_r: LoRA rank.
        block_size: consecutive decoder layers per streamed block.
        quantization: one of ``nf4-dq`` (default), ``nf4``, ``fp4``, ``none``.
        prefetch: blocks copied ahead of the one computing; the GPU holds ``max(2, prefetch + 1)`` slots.
        vram_budget: a GPU budget (bytes or ``"8GB"``) to test the plan against.
        lora_targets: linear layer names LoRA adapts (default: the family's registry entry).

    Returns:
        The plan; every size is in bytes (see :class:`MemoryPlan` for which are estimates).

    Raises:
        PorosConfigError: an argument is out of range.
    """
    shapes = cfg if isinstance(cfg, ModelShapes) else model_shapes(cfg)
    _check_positive(seq_len=seq_len, batch_size=batch_size, lora_r=lora_r, block_size=block_size)
    if not isinstance(prefetch, int) or prefetch < 0:
        raise PorosConfigError(f"prefetch={prefetch!r} must be an integer >= 0.", hint="pass prefetch=1.")
    if quantization not in QUANTIZATIONS:
        raise PorosConfigError(
            f"unknown quantization {quantization!r}.", hint=f"use one of {', '.join(QUANTIZATIONS)}."
        )
    n = shapes.num_layers
    if block_size > n:
        raise PorosConfigError(
            f"block_size={block_size} exceeds the model's {n} decoder layers.", hint=f"pass block_size <= {n}."
        )
    budget = parse_bytes(vram_budget) if vram_budget is not None else None
    targets = frozenset(lora_targets if lora_targets is not None else _default_targets(shapes.model_type))
    tokens = batch_size * seq_len
    hidden, vocab = shapes.hidden_size, shapes.vocab_size

    layer_q = [sum(quantized_weight_bytes(lin.weight_numel, quantization) for lin in x.linears) for x in shapes.layers]
    layer_act = [tokens * _layer_activation_per_token(x, targets, hidden) for x in shapes.layers]
    largest_weight = max(lin.weight_numel for x in shapes.layers for lin in x.linears)

    resident_params = (
        shapes.embed_params
        + shapes.head_params
        + shapes.norm_params
        + shapes.outside_small_params
        + sum(x.small_params for x in shapes.layers)
        + sum(lin.out_features for lin in shapes.outside_linears if lin.bias)
    )
    resident = _BF16 * resident_params + sum(
        quantized_weight_bytes(lin.weight_numel, quantization) for lin in shapes.outside_linears
    )
    lora_params = lora_r * sum(
        lin.in_features + lin.out_features for x in shapes.layers for lin in x.linears if lin.name in targets
    )
    lora = _LORA_BYTES_PER_PARAM * lora_params

    boundary = tokens * hidden * _BF16  # one hidden-state tensor
    logits = tokens * vocab * (_BF16 + 4 + 4)
    # Shared by every mode: the bf16 weight bitsandbytes dequantizes for one matmul, the gradients flowing
    # across a block boundary (output and input), and the logits with their fp32 upcast and gradient.
    common = _BF16 * largest_weight + 2 * boundary + logits

    def streamed(bs: int) -> tuple[int, int, int]:
        starts = range(0, n, bs)
        block_bytes = max(sum(layer_q[s : s + bs]) for s in starts)
        act = len(starts) * boundary + max(sum(layer_act[s : s + bs]) for s in starts) + common
        return block_bytes, act, resident + lora + max(2, prefetch + 1) * block_bytes + act

    per_block, act_streamed, streamed_min = streamed(block_size)
    act_resident = sum(layer_act) + common
    act_resident_gc = n * boundary + max(layer_act) + common
    base = sum(layer_q)
    resident_vram = base + resident + lora + act_resident
    resident_vram_gc = base + resident + lora + act_resident_gc
    largest_layer_bf16 = _BF16 * max(x.linear_weight_params for x in shapes.layers)

    fits = resident_fits = min_budget = max_block = None
    if budget is not None:
        fits = streamed_min <= budget
        resident_fits = resident_vram_gc <= budget
        min_budget = streamed_min
        fitting = [bs for bs in range(1, n + 1) if streamed(bs)[2] <= budget]
        max_block = max(fitting) if fitting else None

    return MemoryPlan(
        model_type=shapes.model_type,
        seq_len=seq_len,
        batch_size=batch_size,
        lora_r=lora_r,
        block_size=block_size,
        prefetch=prefetch,
        quantization=quantization,
        num_layers=n,
        num_blocks=_ceil_div(n, block_size),
        slots=max(2, prefetch + 1),
        params_total=shapes.params_total,
        nf4_base_bytes=base,
        per_block_bytes=per_block,
        resident_bytes=resident,
        lora_params=lora_params,
        lora_bytes=lora,
        activation_streamed_bytes=act_streamed,
        activation_resident_bytes=act_resident,
        activation_resident_gc_bytes=act_resident_gc,
        streamed_vram_min=streamed_min,
        resident_vram=resident_vram,
        resident_vram_gc=resident_vram_gc,
        host_ram_streamed=base + resident + largest_layer_bf16,
        vram_budget=budget,
        fits=fits,
        resident_fits=resident_fits,
        min_budget=min_budget,
        max_block_size=max_block,
        notes=shapes.notes,
        activation_layer_bytes=max(layer_act),
    )


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
        inputs_on_host: each recomputing layer's saved input waits in host memory.
        optimizer_on_host: keep the optimizer's moments in host memory between steps.
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
            "inputs_on_host": self.inputs_on_host,
        }


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    return cfg.get("text_config") or cfg


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
    the head out.

    With the head in host memory, its backward's copy is the one copy nothing hides. When the budget (less
    10% headroom) also holds the head beside the logits, the plan keeps the forward's copy for the backward
    (``head_copies=1``, one head copy per step). It does not move the layers' inputs out to make room: on the
    H200 that costs the step more than the head's copy saves (docs/benchmarks.md).

    Memory left over (10% of the budget is kept as headroom) buys either of two things. Resident blocks (spread
    over the model, copied once: two copies fewer each per step) pay where the link bounds the step; kept
    activations (``keep_activations``: the last layers skip their recompute, one layer forward fewer each per
    step) pay where compute or kernel launches bound it. When a block's copy at ``link_gbps`` (default
    :data:`DEFAULT_LINK_GBPS`) takes longer than a layer's forward (:data:`LAYER_FORWARD_S`), the layers are
    link-bound and resident blocks come first, kept activations from what is left; otherwise kept activations
    come first, resident blocks from what is left (every layer kept, or less than one more layer's
    activations). ``keep_activations=False``, and models whose layers share keys and values (which cannot keep
    them), spend it all on resident blocks.

    Note: [link-bound layers]
        At Qwen2.5-72B on the H200 (seq 512), a 453 MB block takes 8.2 ms to copy at 55 GB/s, twice a layer's
        forward: the streamed forward waits on copies whatever else is on the device. With 24 GB, 22 spread
        resident blocks ran at 1.10x a resident step, while the same memory spent on 31 layers' kept
        activations ran at 1.33x (docs/benchmarks.md, "72B: where the time goes"). At 7B a block copies in
        2.3 ms and kept activations remain the better use.
    Larger blocks are not chosen: a layer per block already hides copies behind compute, and smaller slots
    leave more room for the rest.

    Raises:
        PorosOOMError: even the smallest plan does not fit; the message gives the smallest budget that would.
    """
    from poros_lightning.errors import PorosOOMError

    budget = parse_bytes(vram_budget)
    plan = plan_memory(
        cfg, seq_len=seq_len, batch_size=batch_size, lora_r=lora_r, block_size=1, quantization=quantization,
        prefetch=1, lora_targets=lora_targets,
    )  # fmt: skip
    text = _text_config(cfg)
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    table = int(text["vocab_size"]) * int(text["hidden_size"]) * _BF16
    tokens = batch_size * seq_len
    moments = plan.lora_params * 8  # AdamW's exp_avg and exp_avg_sq, fp32
    slots = plan.slots * plan.per_block_bytes
    # The forward/backward peak, and the optimizer update's peak once the moments live on the host:
    # adapter + gradient + moments + one fp32 temporary as large as a moment (AdamW's sqrt), the slots,
    # and whatever of the resident part stays on the device.
    fwd = plan.streamed_vram_min
    why = [f"host-side options off (block_size 1, 2 x {format_bytes(plan.per_block_bytes)} slots): {format_bytes(fwd)}"]
    embed_host = head_host = opt_host = False
    resident_left = plan.resident_bytes

    def need() -> int:
        update = resident_left + slots + plan.lora_bytes + plan.lora_params * 4
        # The moments come in during the backward's last quarter (Note: [when the state moves]), beside
        # the adapter, its gradient and one layer's recompute.
        tail = resident_left + slots + plan.lora_bytes + plan.activation_layer_bytes
        return max(fwd, update, tail) if opt_host else fwd

    if need() > budget and not tied:
        embed_host = True
        fwd -= table
        resident_left -= table
        why.append(f"input embeddings in host memory saves {format_bytes(table)}: {format_bytes(need())}")
    if need() > budget and moments:
        opt_host = True
        fwd -= moments
        why.append(
            f"optimizer moments in host memory (two copies of {format_bytes(moments)} per step): {format_bytes(need())}"
        )
    if need() > budget and not tied and head_frozen:
        head_host = True
        saved = min(table, 8 * tokens * int(text["vocab_size"]))
        fwd -= saved
        resident_left -= table
        why.append(
            f"LM head in host memory (two head copies per step) saves {format_bytes(saved)}: {format_bytes(need())}"
        )
    inputs = plan.num_layers * tokens * int(text["hidden_size"]) * _BF16  # one saved hidden state per layer
    inputs_host = False
    if need() > budget:
        inputs_host = True
        fwd -= inputs
        why.append(
            f"layer inputs in host memory (two copies of {format_bytes(inputs)} per step): {format_bytes(need())}"
        )
    head_copies = 2
    if head_host:
        saved_fwd = fwd
        fwd += min(table, 8 * tokens * int(text["vocab_size"]))
        if need() <= int(budget * 0.9):
            head_copies = 1
            why.append(f"the head's forward copy serves its backward (one head copy per step): {format_bytes(need())}")
        else:
            fwd = saved_fwd
    total = need()
    if total > budget:
        raise PorosOOMError(
            f"The smallest streamed plan needs about {format_bytes(total)} of GPU memory at seq_len {seq_len}, "
            f"batch {batch_size}, LoRA r{lora_r}; the budget is {format_bytes(budget)}.",
            f"Use vram_budget >= {format_bytes(total)}, or a shorter seq_len / smaller batch / lower LoRA rank.",
            needed_bytes=total,
        )
    spare = int(budget * 0.9) - total  # 10% headroom for allocator fragmentation and estimate error
    kept = 0
    if int(text.get("num_kv_shared_layers") or 0):
        keep_activations = False  # refused by prepare(): a later layer's backward reads an earlier layer's K/V
    gbps = float(link_gbps) if link_gbps else DEFAULT_LINK_GBPS
    copy_s = plan.per_block_bytes / (gbps * 1e9)
    link_bound = copy_s > LAYER_FORWARD_S
    resident = 0
    if keep_activations and spare > 0:
        why.append(
            f"a block copies in {copy_s * 1e3:.1f} ms at {gbps:.1f} GB/s, "
            + (
                f"longer than a layer's forward (about {LAYER_FORWARD_S * 1e3:.0f} ms): resident blocks first"
                if link_bound
                else f"within a layer's forward (about {LAYER_FORWARD_S * 1e3:.0f} ms): kept activations first"
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
    )
