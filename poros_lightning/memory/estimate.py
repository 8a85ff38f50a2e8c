"""Memory model: what a QLoRA run of a model needs on the GPU and in host RAM, streamed or resident.

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

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poros_lightning.arch.registry import STANDARD_TARGETS, registered
from poros_lightning.arch.shapes import LayerShape, ModelShapes, model_shapes
from poros_lightning.errors import PorosConfigError
from poros_lightning.memory.sizes import (
    BF16,
    LORA_BYTES_PER_PARAM,
    QUANTIZATIONS,
    ceil_div,
    parse_bytes,
    quantized_weight_bytes,
)

__all__ = [
    "BLAS_WORKSPACE_BYTES",
    "HEADROOM",
    "DEQUANT_HEADROOM",
    "LAYER_SAVES_FACTOR",
    "LOGITS_HEADROOM",
    "MemoryPlan",
    "blas_workspace_bytes",
    "budget_for",
    "headroom_for",
    "plan_memory",
]


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
            dequantized weight in flight, the boundary gradients, and the logits (bf16, fp32 upcast, fp32 grad;
            of one chunk with ``loss_chunk_tokens``).
        activation_resident_bytes: estimate for a resident run without gradient checkpointing.
        activation_resident_gc_bytes: estimate for a resident run with per-layer gradient checkpointing.
        activation_layer_bytes: estimate: what the largest decoder layer saves when it keeps its activations
            (``keep_activations``) instead of recomputing them.
        recompute_layer_bytes: estimate: what the largest decoder layer's recompute holds (one micro-batch): its
            saved activations and its transient working set (:func:`_layer_transient_per_token`).
        backward_extra_bytes: what a layer's backward holds beside its recompute and the adapter: the dequantized
            weight, the boundary gradients of every micro-batch and, block-major, the per-micro-batch LoRA
            gradients that wait for their ordered sum.
        boundary_bytes: one hidden state of every micro-batch (a layer's saved input, block-major: all k).
        workspace_bytes: the cuBLAS workspaces a training step holds (:func:`blas_workspace_bytes`).
        streamed_vram_min: resident + LoRA + ``slots`` block slots + streamed activations + workspaces.
        resident_vram: NF4 base + resident + LoRA + activations without checkpointing + workspaces.
        resident_vram_gc: the same with gradient checkpointing.
        host_ram_streamed: pinned NF4 base + a host copy of the resident modules while loading + one layer in
            bf16 while it is quantized.
        vram_budget: the budget asked about, if any.
        fits: whether the streamed run fits ``vram_budget`` (within its usable part: Note: [headroom]).
        resident_fits: whether a resident run with gradient checkpointing fits ``vram_budget`` (likewise).
        min_budget: the smallest budget the streamed run needs at this ``block_size`` (``streamed_vram_min`` and
            the headroom).
        max_block_size: the largest ``block_size`` whose streamed run fits ``vram_budget`` (None: none fits).
        notes: what the estimate leaves out for this model.
        loss_chunk_tokens: tokens per chunk of the LM head and loss (``LoRALightningModule(loss_chunk_tokens=...)``),
            or None (unchunked).
        logits_bytes: estimate: the logits term of the activations, ``10 x tokens x vocabulary`` bytes (bf16,
            fp32 upcast, fp32 gradient), of ``min(tokens, loss_chunk_tokens)`` tokens with a chunked loss (of all
            block-major micro-batches' tokens).
        micro_batches: block-major micro-batches of ``batch_size`` per step the plan is for.
        dequant_bytes: the largest linear weight of the layers dequantized to bf16 (what bitsandbytes builds for
            one matmul).
        layer_forward_flops: the largest decoder layer's linear layers in one block's forward, ``2 x weights x
            tokens`` of all ``micro_batches`` (attention scores and LoRA left out): what the planner times a
            layer's forward by.
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
    recompute_layer_bytes: int = 0
    loss_chunk_tokens: int | None = None
    logits_bytes: int = 0
    micro_batches: int = 1
    dequant_bytes: int = 0
    layer_forward_flops: int = 0
    backward_extra_bytes: int = 0
    boundary_bytes: int = 0
    workspace_bytes: int = 0


HEADROOM = 0.10
"""Share of every budget no plan spends. Note: [headroom]
    A card's limit is on what the caching allocator reserves: rounding, fragmentation and the estimate's error
    come on top of the estimated peak. With plans sized to the last byte of a budget (the estimate equal to the
    budget), five of six checkpoints ran out of memory on the H200 (docs/benchmarks/families.jsonl, the
    ``poros_min`` rows); the 16 GB plans that fitted peaked 0.35-0.55 GB above their allocated bytes in reserved
    memory. A plan's estimate therefore stays within 90% of the budget, and what it does not spend the tuner
    may give to kept activations as measured steps show room (``engine/tuner.py``).

    The gap grows with the logits, the largest tensors a step frees and allocates again: reserved ran above the
    allocated peak by 0.3-0.5 GB at Qwen2.5-7B seq 512, 1.0-1.6 GB at seq 2048 and 1.5-2.2 GB at seq 4096, and by
    0.9-1.0 GB at the 262k-vocabulary Gemma checkpoints at seq 512, where a 10% headroom of a 6.9 GB minimum plan
    ran out of memory (docs/benchmarks/planner_sweep.jsonl, families.jsonl). So the headroom is also at least
    :data:`LOGITS_HEADROOM` times the logits term (``10 x tokens x vocabulary`` bytes, or a chunk's with a
    chunked loss).

    At the smallest plans neither share is large enough: Mistral-7B's minimum plan (1.28 GB, 134 MB headroom) ran
    out on the H100 at 1.24 GB allocated, 0.09 GB above its estimate, in bitsandbytes' backward
    ``grad_A = grad_output @ dequantize(W)`` (docs/benchmarks/families.jsonl, the ``oom_*`` fields). What the
    estimate leaves out there grows with the layer's matmuls, not with the budget: a second dequantized weight
    beside its matmul's output, cuBLAS's workspace, the allocator's rounding (2 MB pages, 20 MB blocks for
    requests of 1-10 MB). So the headroom is also at least :data:`DEQUANT_HEADROOM` times the largest weight
    dequantized to bf16 (235 MB at Mistral-7B, where the run needed about 165 MB more than its estimate)."""

DEQUANT_HEADROOM = 2.0
"""Headroom kept per byte of the largest dequantized (bf16) weight (Note: [headroom])."""

LOGITS_HEADROOM = 0.8
"""Headroom kept per byte of the estimate's logits term (Note: [headroom])."""


def headroom_for(budget: int, logits_bytes: int = 0, dequant_bytes: int = 0) -> int:
    """Bytes of ``budget`` that no plan spends: :data:`HEADROOM` of it, at least ``LOGITS_HEADROOM x logits`` and
    ``DEQUANT_HEADROOM x`` the largest dequantized weight."""
    return max(int(budget * HEADROOM), int(LOGITS_HEADROOM * logits_bytes), int(DEQUANT_HEADROOM * dequant_bytes))


def budget_for(need: int, logits_bytes: int = 0, dequant_bytes: int = 0) -> int:
    """The smallest budget whose usable part (all but :func:`headroom_for`) holds ``need`` bytes."""
    keep = round((1 - HEADROOM) * 100)
    fixed = max(int(LOGITS_HEADROOM * logits_bytes), int(DEQUANT_HEADROOM * dequant_bytes))
    budget = max(-(-need * 100 // keep), need + fixed)
    while budget > 1 and budget - 1 - headroom_for(budget - 1, logits_bytes, dequant_bytes) >= need:  # rounding
        budget -= 1
    while budget - headroom_for(budget, logits_bytes, dequant_bytes) < need:
        budget += 1
    return budget


BLAS_WORKSPACE_BYTES = 32 * 2**20
"""torch's cuBLAS workspace per (handle, stream), ``CUBLAS_WORKSPACE_CONFIG`` unset: 32 MiB on Hopper, less before."""


def blas_workspace_bytes(environ: Mapping[str, str] | None = None) -> int:
    """Bytes of the cuBLAS workspaces a training step holds on the device: two, each of ``CUBLAS_WORKSPACE_CONFIG``'s
    size (``:4096:8`` is 8 buffers of 4096 KiB) or :data:`BLAS_WORKSPACE_BYTES`.

    Note: [cuBLAS workspaces]
        torch allocates one workspace per cuBLAS handle and stream through the caching allocator (it counts in
        ``memory_allocated``) and keeps it; handles are per thread, and a step's matmuls run on two: the forward on
        the caller's, the backward on the autograd engine's (cuBLASLt shares the cuBLAS workspace). Left out, the
        update's estimate of the minimum plans at Qwen2.5-7B, 32B and 72B sat 69-71 MB under the measured peaks
        (1.049, 3.190, 5.120 GB against 1.118, 3.260, 5.191 GB, H200, docs/benchmarks/recipes.jsonl, 2026-12-07),
        and a 32B step found 1.112 GB allocated before it began against 1.042 GB of adapter, slots and norms
        (``memtrace_before_gb``). Two 32 MiB workspaces are 67 MB.
    """
    env = os.environ if environ is None else environ
    config = env.get("CUBLAS_WORKSPACE_CONFIG", "").strip()
    fields = config.strip(":").split(":") if config else []
    if len(fields) >= 2 and len(fields) % 2 == 0 and all(f.isdigit() for f in fields):
        per_handle = sum(int(size) * 1024 * int(count) for size, count in zip(fields[::2], fields[1::2], strict=True))
    else:
        per_handle = BLAS_WORKSPACE_BYTES  # unset or not torch's form: torch warns and uses its default
    return 2 * per_handle


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
    return 4 * adapted_in + 3 * BF16 * widest + 4 * BF16 * hidden + 2 * 4 * hidden


def _layer_transient_per_token(layer: LayerShape, targets: frozenset[str]) -> int:
    """Bytes per token a decoder layer's forward (or recompute) holds only while it runs, beside what it saves: the
    fp32 output of the widest adapted projection's LoRA path (PEFT computes the adapters in fp32; ``lora_B``'s
    output is scaled into a second fp32 tensor before the sum, the first still alive).

    At Qwen2.5-7B, seq 4096, 4 rows per micro-batch, that is 1.24 GB (16384 tokens x 18944 x 4 bytes): the
    minimum plan ran out of memory asking for it in PEFT's ``lora_B(lora_A(dropout(x))) * scaling``, and without
    the cap it peaked 0.47 GB above an estimate without this term (docs/benchmarks/recipes.jsonl, runs
    ``2026-12-07T00:23:39`` and ``00:25:33``). At 512 tokens it is 39 MB.
    """
    adapted = [lin.out_features for lin in layer.linears if lin.name in targets]
    return 4 * max(adapted) if adapted else 0


LAYER_SAVES_FACTOR: dict[str, float] = {
    "qwen3": 1.1,
    "qwen3_5_text": 2.25,
    "qwen3_5": 2.25,
    "gemma3_text": 1.2,
    "gemma3": 1.2,
    "gemma4_text": 1.5,
    "gemma4": 1.5,
}
"""What a decoder layer of these families saves beyond :func:`_layer_activation_per_token` (1.0 for the others).

Measured, not derived: a decoder layer's forward under PEFT LoRA (dropout 0) on the CPU, every tensor its autograd
graph saves counted once by storage (parameters excluded), at each family's proportions
(``tests/test_activation_estimate.py`` re-measures it and holds the estimate between 1.0 and 1.25 times the
measurement). Largest layer over the formula, seq 256 and 512: qwen2, llama, mistral 0.98; qwen3 1.09 (the q/k
norms save fp32 copies); gemma3 1.17 and gemma4 1.44 (four norms per layer, q/k norms, and Gemma 4's global layers
with ``global_head_dim`` 512); qwen3_5 2.17 (the Gated DeltaNet layers, on transformers' PyTorch reference kernels,
save their chunked intermediates). Those families ran out of memory on the H200 under plans sized without it
(docs/benchmarks/families.jsonl). The rows, full-width layers included: docs/validation/activation_estimate.jsonl
(:mod:`poros_lightning.tools.activation_probe`)."""


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
    loss_chunk_tokens: int | None = None,
    micro_batches: int = 1,
    workspace_bytes: int | None = None,
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
        loss_chunk_tokens: the LM head and the loss computed this many tokens at a time
            (``LoRALightningModule(loss_chunk_tokens=...)``): the logits term counts one chunk, not every token.
        micro_batches: ``k`` block-major micro-batches of ``batch_size`` rows per step
            (``PorosStrategy(micro_batches=k)``): every layer's input and the boundary gradients are kept for all
            ``k``, a kept layer keeps all ``k`` micro-batches' activations, the unchunked logits are those of all
            ``k``; a recompute holds one micro-batch (Note: [one checkpoint per micro-batch] in engine.microbatch).
            The resident figures are those of a resident run accumulating the ``k`` one after the other.
        workspace_bytes: the cuBLAS workspaces held (None: :func:`blas_workspace_bytes`, CUDA's; 0 elsewhere).

    Returns:
        The plan; every size is in bytes (see :class:`MemoryPlan` for which are estimates).

    Raises:
        PorosConfigError: an argument is out of range.
    """
    shapes = cfg if isinstance(cfg, ModelShapes) else model_shapes(cfg)
    _check_positive(
        seq_len=seq_len, batch_size=batch_size, lora_r=lora_r, block_size=block_size, micro_batches=micro_batches
    )
    if loss_chunk_tokens is not None:
        _check_positive(loss_chunk_tokens=loss_chunk_tokens)
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
    factor = LAYER_SAVES_FACTOR.get(shapes.model_type, 1.0)
    layer_act = [int(tokens * _layer_activation_per_token(x, targets, hidden) * factor) for x in shapes.layers]
    # One layer runs at a time: its transient working set comes on top of what the layers around it saved.
    transient = tokens * max(_layer_transient_per_token(x, targets) for x in shapes.layers)
    largest_weight = max(lin.weight_numel for x in shapes.layers for lin in x.linears)

    resident_params = (
        shapes.embed_params
        + shapes.head_params
        + shapes.norm_params
        + shapes.outside_small_params
        + sum(x.small_params for x in shapes.layers)
        + sum(lin.out_features for lin in shapes.outside_linears if lin.bias)
    )
    resident = BF16 * resident_params + sum(
        quantized_weight_bytes(lin.weight_numel, quantization) for lin in shapes.outside_linears
    )
    layer_lora = [
        lora_r * sum(lin.in_features + lin.out_features for lin in x.linears if lin.name in targets)
        for x in shapes.layers
    ]
    lora_params = sum(layer_lora)
    lora = LORA_BYTES_PER_PARAM * lora_params

    boundary = tokens * hidden * BF16  # one hidden-state tensor
    # A chunked loss holds one chunk's logits at a time, in the forward and again in the backward's recompute.
    logits = min(tokens, loss_chunk_tokens or tokens) * vocab * (BF16 + 4 + 4)
    # Shared by every mode: the bf16 weight bitsandbytes dequantizes for one matmul, the gradients flowing
    # across a block boundary (output and input), and the logits with their fp32 upcast and gradient.
    common = BF16 * largest_weight + 2 * boundary + logits
    # Block-major: the inputs, the boundary gradients and the unchunked logits of all k micro-batches at once.
    k = micro_batches
    boundary_all = k * boundary
    logits_all = min(k * tokens, loss_chunk_tokens or k * tokens) * vocab * (BF16 + 4 + 4)
    # Block-major: a layer's LoRA gradients of all k micro-batches wait for their ordered sum (Note: [a parameter's
    # sum when its last gradient arrives] in engine.microbatch), fp32.
    grad_store = 4 * k * max(layer_lora) if k > 1 else 0
    common_all = BF16 * largest_weight + 2 * boundary_all + logits_all + grad_store

    workspace = blas_workspace_bytes() if workspace_bytes is None else workspace_bytes  # Note: [cuBLAS workspaces]

    def streamed(bs: int) -> tuple[int, int, int]:
        starts = range(0, n, bs)
        block_bytes = max(sum(layer_q[s : s + bs]) for s in starts)
        act = len(starts) * boundary_all + max(sum(layer_act[s : s + bs]) for s in starts) + transient + common_all
        return block_bytes, act, resident + lora + max(2, prefetch + 1) * block_bytes + act + workspace

    per_block, act_streamed, streamed_min = streamed(block_size)
    act_resident = sum(layer_act) + transient + common
    act_resident_gc = n * boundary + max(layer_act) + transient + common
    base = sum(layer_q)
    resident_vram = base + resident + lora + act_resident + workspace
    resident_vram_gc = base + resident + lora + act_resident_gc + workspace
    largest_layer_bf16 = BF16 * max(x.linear_weight_params for x in shapes.layers)

    fits = resident_fits = min_budget = max_block = None
    if budget is not None:  # every figure keeps headroom_for(budget) for the allocator, as the planner does
        usable = budget - headroom_for(budget, logits_all, BF16 * largest_weight)
        fits = streamed_min <= usable
        resident_fits = resident_vram_gc <= usable
        min_budget = budget_for(streamed_min, logits_all, BF16 * largest_weight)
        fitting = [bs for bs in range(1, n + 1) if streamed(bs)[2] <= usable]
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
        num_blocks=ceil_div(n, block_size),
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
        activation_layer_bytes=k * max(layer_act),
        recompute_layer_bytes=max(layer_act) + transient,
        loss_chunk_tokens=loss_chunk_tokens,
        logits_bytes=logits_all,
        micro_batches=micro_batches,
        dequant_bytes=BF16 * largest_weight,
        backward_extra_bytes=common_all - logits_all,
        boundary_bytes=boundary_all,
        workspace_bytes=workspace,
        layer_forward_flops=2 * micro_batches * tokens * max(x.linear_weight_params for x in shapes.layers),
    )
