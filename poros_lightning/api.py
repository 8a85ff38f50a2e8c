"""``prepare(model)`` / ``unprepare(model)``: the one-line path onto an existing HF/PEFT training loop.

Invariant: between ``prepare`` and ``unprepare`` the model computes exactly what the resident model
computed (same kernels, same bytes, same RNG draws); only where the frozen base bytes live changes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from poros_lightning import quant
from poros_lightning.arch import arch_for_model, resolve
from poros_lightning.engine import EngineOptions, StreamingEngine, move_resident
from poros_lightning.engine.head import HostHead, check_frozen_head, check_head_copies
from poros_lightning.engine.store import ArenaFactory
from poros_lightning.errors import PorosConfigError

__all__ = [
    "check_block_major",
    "check_linear_attention_kernels",
    "engine_of",
    "install_block_major",
    "is_prepared",
    "prepare",
    "unprepare",
]

log = logging.getLogger(__name__)

_ATTR = "_poros_engine"


def _base(model: nn.Module) -> nn.Module:
    """The HF causal LM under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def engine_of(model: nn.Module) -> StreamingEngine | None:
    """The engine attached to ``model`` by :func:`prepare`, or ``None``."""
    return getattr(_base(model), _ATTR, None)


def input_grads_hooked(model: nn.Module) -> bool:
    """Whether transformers' ``enable_input_require_grads`` hook is on ``model``'s base (gradient checkpointing and
    ``prepare_model_for_kbit_training`` turn it on): the embeddings' output then requires grad."""
    return bool(getattr(_base(model), "_require_grads_hooks", None))


def is_prepared(model: nn.Module) -> bool:
    """Whether :func:`prepare` was applied to ``model`` (and not undone)."""
    return engine_of(model) is not None


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class HostEmbedding:
    """Keeps an embedding module's table in (pinned) host memory; its output is copied to the device.

    The lookup runs on the host with the module's own forward (scaling included), so the activations
    are the exact bytes the device lookup would produce; the frozen table never touches the device.
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        weight = module.weight
        host = weight.detach().to("cpu")
        if device.type == "cuda":
            host = host.pin_memory()
        weight.data = host
        self._previous = module.__dict__.get("forward")
        self._original = module.forward
        module.forward = self._forward
        module._poros_on_host = True  # resident-part moves skip this module

    def _forward(self, input_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        # The ids go to the host (one small copy per step); the rows come back asynchronously.
        out = self._original(input_ids.to("cpu"), *args, **kwargs)
        return out.to(self.device, non_blocking=self.device.type == "cuda")

    def detach(self, device: torch.device | str) -> None:
        if self._previous is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self._previous
        self.module.weight.data = self.module.weight.data.to(device)
        self.module.__dict__.pop("_poros_on_host", None)


def _host_embedding(base: nn.Module, embed_path: str, head_path: str, device: torch.device) -> HostEmbedding | None:
    embed = resolve(base, embed_path)
    head = _resolve_or_none(base, head_path)  # a model without a head module: nothing can be tied
    if head is not None and getattr(head, "weight", None) is embed.weight:
        log.info("poros: embeddings are tied to the LM head; keeping them on %s.", device)
        return None
    return HostEmbedding(embed, device)


def _resolve_or_none(base: nn.Module, path: str) -> nn.Module | None:
    try:
        return resolve(base, path)
    except Exception:  # e.g. a model without a head module
        return None


def _host_head(
    base: nn.Module,
    embed_path: str,
    head_path: str,
    engine: StreamingEngine,
    copies: int = 2,
    prefetch: bool = True,
) -> HostHead | None:
    head = _resolve_or_none(base, head_path)
    weight = getattr(head, "weight", None)
    if weight is None:
        log.info("poros: the model has no LM head weight to keep in host memory.")
        return None
    if weight is getattr(resolve(base, embed_path), "weight", None):
        log.info("poros: the LM head is tied to the input embeddings; keeping it on %s.", engine.device)
        return None
    ring = engine.ring
    host_head = HostHead(head, engine.device, ring.copy_stream if ring.use_streams else None, copies=copies)
    if prefetch:
        host_head.schedule(len(engine.layers), engine.store.max_block_bytes / engine.options.block_size)
        engine.streamer.on_forward.append(host_head.on_layer_forward)  # Note: [prefetch] in engine.head
    return host_head


def _check_no_shared_kv(base: nn.Module) -> None:
    """Refuse kept activations on a model whose layers share keys and values (Note: [kept activations])."""
    config = getattr(base, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    if shared:
        raise PorosConfigError(
            f"This {getattr(config, 'model_type', 'model')} shares keys and values between layers "
            f"(num_kv_shared_layers={shared}); a layer that keeps its activations would be differentiated "
            "before its block is reloaded.",
            "Use keep_activations=0 (the default) for this model: its layers recompute, which is exact.",
        )


def prepare(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    block_size: int = 1,
    prefetch: int = 1,
    num_slots: int | None = None,
    pin_memory: bool = True,
    use_streams: bool = True,
    resident_blocks: int = 0,
    keep_activations: int = 0,
    embeddings_on_host: bool = False,
    head_on_host: bool = False,
    head_copies: int = 2,
    head_prefetch: bool = True,
    inputs_on_host: bool = False,
    allow_unlisted_arch: bool = False,
    arena_factory: ArenaFactory | None = None,
) -> nn.Module:
    """Stream the frozen base of ``model`` from host memory; keep everything else on ``device``.

    ``model`` is a (PEFT-wrapped) Hugging Face causal LM of a registered architecture, quantized by
    bitsandbytes or not. Its decoder layers are wrapped in place (module names and ``state_dict``
    keys do not change); their frozen weights move to a host store and stream through a ring of
    device slots; embeddings, norms, the head and the adapters move to ``device``.

    Args:
        model: the model, on any device (typically the CPU it was built on).
        device: compute device; the current CUDA device when available, else the CPU.
        block_size: decoder layers per streamed block.
        prefetch: blocks copied ahead of the one computing.
        num_slots: device slots in the ring (default ``prefetch + 1``).
        pin_memory: page-lock the host store (CUDA only).
        use_streams: copy on a side CUDA stream (ignored on CPU, where copies are synchronous).
        resident_blocks: this many blocks, spread over the model, stay on the device (copied once) when memory allows.
        keep_activations: the last ``keep_activations`` decoder layers keep their activations until the
            backward instead of recomputing them (exact; fewer kernels per step, more memory). A number
            >= the layer count keeps every layer's.
        embeddings_on_host: keep the input embedding table in host memory; rows are gathered on the
            host and only the activations are copied (exact: a lookup is a copy). Ignored, with a log
            line, when the embeddings are tied to the LM head.
        head_on_host: keep the LM head's weight (untied, frozen) in pinned host memory between uses.
        head_copies: with ``head_on_host``, copies of the head's weight per step: 2 (for its forward and
            again for its backward; the weight and the fp32 logits never share the device) or 1 (the
            forward's copy is kept until the head's backward: one copy fewer, for the overlap).
        head_prefetch: with ``head_on_host``, copy the head in during the last decoder layers' forwards (hidden
            behind them; the weight then shares the device with those layers' forwards) or, ``False``, when
            the head runs (nothing of the layers' forwards beside it; the copy is not hidden).
        inputs_on_host: each recomputing layer's saved input (its hidden state) waits in pinned host
            memory from the forward to the backward (exact; copied out and back on side streams).
        allow_unlisted_arch: try an architecture missing from the registry, as experimental.
        arena_factory: ``(block, nbytes) -> (uint8 CPU tensor, already_filled)`` supplying the host
            arena of each block (e.g. shared memory, one copy of the base for several processes);
            plain host allocations when ``None``.

    Returns:
        The same ``model``, prepared.

    Raises:
        UnsupportedArchitectureError: the architecture is not registered.
        PorosOOMError: the slots do not fit on the device.
    """
    if is_prepared(model):
        raise PorosConfigError("The model is already prepared for streaming.", "Call unprepare(model) first.")
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    base = _base(model)
    spec = arch_for_model(base, allow_unlisted=allow_unlisted_arch)
    layers = list(resolve(base, spec.layers))
    if input_grads_hooked(base):
        log.warning(
            "poros: the input embeddings make their output require grad (enable_input_require_grads, which "
            "gradient checkpointing and prepare_model_for_kbit_training turn on): the backward computes a gradient "
            "of that output which nothing reads and keeps it beside the output until the graph is freed: two tensors "
            "of tokens x hidden that prepare()'s options do not count. Streamed layers do not need it: call "
            "model.disable_input_require_grads() before prepare()."
        )
    options = EngineOptions(
        block_size=block_size,
        prefetch=prefetch,
        num_slots=num_slots,
        pin_memory=pin_memory,
        use_streams=use_streams,
        resident_blocks=resident_blocks,
        keep_activations=keep_activations,
        inputs_on_host=inputs_on_host,
    )
    check_head_copies(head_copies)  # refused before anything moves
    if keep_activations:
        _check_no_shared_kv(base)
    check_linear_attention_kernels(base, device)
    quant.disable_cpu_repacking(model)
    refs = [list(quant.streamable_tensors(layer)) for layer in layers]
    if not any(refs):
        raise PorosConfigError(
            "The decoder layers hold no frozen linear weights to stream.",
            "Freeze the base (PEFT does this) before prepare(), or train it without poros-lightning.",
        )
    if head_on_host:  # refused before anything moves
        head = _resolve_or_none(base, spec.head)
        if getattr(head, "weight", None) is not None:
            check_frozen_head(head)
    checkpointing = getattr(base, "is_activation_checkpointing", None)
    if checkpointing is None:  # older transformers
        checkpointing = getattr(base, "is_gradient_checkpointing", False)
    if checkpointing:
        log.info("Disabling Hugging Face gradient checkpointing: streamed layers recompute on their own.")
        # transformers 5.x renamed gradient_checkpointing_* (the old names warn); older releases have only those.
        disable = getattr(base, "activation_checkpointing_disable", None) or base.gradient_checkpointing_disable
        disable()
    engine = StreamingEngine(layers, refs, device, options, arena_factory=arena_factory)
    quant.move_quant_states(model, device)
    engine.host_embedding = _host_embedding(base, spec.embed, spec.head, device) if embeddings_on_host else None
    engine.host_head = (
        _host_head(base, spec.embed, spec.head, engine, head_copies, head_prefetch) if head_on_host else None
    )
    move_resident(model, device)
    config = getattr(base, "config", None)
    engine.saved_use_cache = getattr(config, "use_cache", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # a KV cache would be written twice by the recompute
    setattr(base, _ATTR, engine)
    log.info(
        "poros: streaming %d layers in %d blocks (%.1f MiB each, %d slots, prefetch %d) on %s; host store %.2f GiB%s",
        len(layers),
        engine.num_blocks,
        engine.store.max_block_bytes / 2**20,
        engine.options.num_slots,
        engine.options.prefetch,
        device,
        engine.store.total_bytes / 2**30,
        ", pinned" if engine.store.pinned and device.type == "cuda" else "",
    )
    return model


def unprepare(model: nn.Module, *, device: torch.device | str | None = None, copy: bool = True) -> nn.Module:
    """Undo :func:`prepare`: every weight gets its own memory on ``device`` (default: the compute device).

    Args:
        model: a prepared model.
        device: where the base goes (default: the compute device).
        copy: ``False`` (with ``device="cpu"``) makes the base's tensors views into the host store
            instead of copies: no extra host memory, and a store shared between processes stays shared.

    Returns:
        The same ``model``, an ordinary resident model again.
    """
    engine = engine_of(model)
    if engine is None:
        raise PorosConfigError("The model is not prepared for streaming.", "Call prepare(model) first.")
    engine.detach(device, copy=copy)
    base = _base(model)
    if engine.host_embedding is not None:
        engine.host_embedding.detach(device if device is not None else engine.device)
    if engine.host_head is not None:
        engine.host_head.detach(device if device is not None else engine.device)
    config = getattr(base, "config", None)
    if config is not None and engine.saved_use_cache is not None:
        config.use_cache = engine.saved_use_cache
    delattr(base, _ATTR)
    return model


def options_of(model: nn.Module) -> dict[str, Any]:
    """The engine options of a prepared model, as a plain dict (for logs and checkpoints)."""
    engine = engine_of(model)
    return {} if engine is None else dict(engine.options.__dict__)


_LINEAR_ATTENTION_PACKAGES = ("fla", "causal_conv1d")  # flash-linear-attention, causal-conv1d


def check_linear_attention_kernels(base: nn.Module, device: torch.device) -> None:
    """Refuse the fast linear-attention kernels of Qwen3.5 on CUDA: its GPU gates ran the PyTorch reference ones.

    transformers runs Qwen3.5's Gated DeltaNet layers on ``flash-linear-attention`` and ``causal-conv1d`` when those
    packages are installed (and the inputs are on CUDA), on its PyTorch reference functions otherwise. Only the
    reference path is gated bit-identical (docs/validation/parity_qwen3.5-27b.jsonl, run without them); the fast
    kernels' backward has not been shown deterministic, and a kernel that is not makes the recompute differ.
    transformers 5.x also swaps them in from the Hub when a model is loaded with ``use_kernels`` (the default of
    ``from_pretrained`` where the ``kernels`` package is installed): a kernelized model is refused the same way.
    """
    import importlib.util

    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if device.type != "cuda" or getattr(text, "model_type", None) not in ("qwen3_5_text", "qwen3_5"):
        return
    found = [name for name in _LINEAR_ATTENTION_PACKAGES if importlib.util.find_spec(name) is not None]
    if found:
        raise PorosConfigError(
            f"Qwen3.5's linear-attention layers would run the kernels of {', '.join(found)}, which are not gated "
            "bit-identical: the GPU gates ran transformers' PyTorch reference kernels.",
            "Uninstall flash-linear-attention and causal-conv1d (pip uninstall flash-linear-attention causal-conv1d) "
            "so that transformers runs its reference kernels, or train this model without poros-lightning.",
        )
    if getattr(base, "use_kernels", False):
        raise PorosConfigError(
            "This Qwen3.5 model was kernelized by transformers (use_kernels): its layers may run Hub kernels, "
            "which are not gated bit-identical: the GPU gates ran transformers' PyTorch reference kernels.",
            "Load it with from_pretrained(..., use_kernels=False), call model.reset_kernels() before prepare(), or "
            "set USE_HUB_KERNELS=0.",
        )


def check_block_major(peft_model: nn.Module, who: str, instead: str, device: torch.device | str | None = None) -> bool:
    """Refuse block-major micro-batches where they would not be exact; returns whether dropout draws are replayed.

    Dropout is exact on CUDA, where the Philox generator's offsets are replayed in block-major order (Note:
    [dropout in block-major order] in engine.microbatch), when every dropout module sits in a decoder layer.
    Refused: dropout on another device (the CPU generator has no offset), dropout modules outside the decoder
    layers, and layers sharing keys and values. ``who`` names the caller's option in the message
    (``"PorosStrategy(micro_batches=4)"``); ``instead`` is the exact sample-major alternative the hint offers.
    """
    from poros_lightning.engine.microbatch import dropout_modules, dropout_sources

    base = peft_model.get_base_model()
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if getattr(text, "num_kv_shared_layers", 0):
        raise PorosConfigError(
            f"This {base.config.model_type} model shares keys and values between layers "
            f"(num_kv_shared_layers={text.num_kv_shared_layers}); micro-batches run block-major would read "
            "one another's.",
            f"Use {instead}, which is exact for this model.",
        )
    sources = dropout_sources(peft_model)
    if not sources:
        return False
    where = torch.device(device) if device is not None else None
    if where is None or where.type != "cuda":
        raise PorosConfigError(
            f"{who} runs micro-batches block-major, which draws random numbers in another order than one "
            f"micro-batch after the other; this model draws them in {', '.join(sources[:3])}. On CUDA the draws "
            f"are replayed where one micro-batch after the other makes them; on {where or 'this device'} the "
            "generator cannot be placed.",
            f"Train on a CUDA device, set the LoRA dropout (and any other dropout) to 0, or use {instead} for an "
            "exact run with dropout.",
        )
    spec = arch_for_model(base, allow_unlisted=True)
    inside = {id(m) for layer in resolve(base, spec.layers) for m in layer.modules()}
    outside = [name for name, m in dropout_modules(base) if id(m) not in inside]
    if outside:
        raise PorosConfigError(
            f"{who} replays dropout draws inside the decoder layers only; this model also draws them in "
            f"{', '.join(outside[:3])}, which block-major order runs once for all micro-batches.",
            f"Set that dropout to 0, or use {instead} for an exact run with dropout.",
        )
    return True


def install_block_major(
    peft_model: nn.Module,
    k: int,
    micro_size: int | None,
    *,
    allow_unlisted_arch: bool = False,
    replay_dropout: bool = False,
) -> Any:
    """Install ``k`` block-major micro-batches on the decoder layers, final norm and head of ``peft_model``
    (before :func:`prepare`); returns the splitter, whose ``uninstall()`` removes them. ``replay_dropout``
    (what :func:`check_block_major` returns) places each micro-batch's dropout draws on the CUDA generator where
    layer-major accumulation makes them."""
    from poros_lightning.engine.microbatch import MicroBatches, cuda_generator

    base = peft_model.get_base_model()
    spec = arch_for_model(base, allow_unlisted=allow_unlisted_arch)
    layers = list(resolve(base, spec.layers))
    splitter = MicroBatches(
        base,
        [*layers, resolve(base, spec.norm), resolve(base, spec.head)],
        k,
        layers=len(layers),
        body=resolve(base, spec.body),
        rng=cuda_generator if replay_dropout else None,
    )
    splitter.micro_size = micro_size
    splitter.install()
    return splitter
