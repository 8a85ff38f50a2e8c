"""Streamed NF4 loader: a quantized base in host RAM close to its NF4 size, byte-identical to a resident load.

Invariant: the packed bytes and quant state of every 4-bit layer are what ``Params4bit(w).to(device)``
makes of the checkpoint's weight ``w`` (cast to the compute dtype) on the compute device, which is the
call a resident ``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`` load makes; every
other tensor is the checkpoint's, cast as ``from_pretrained(..., dtype=...)`` casts it. The model is
returned on the CPU: packed NF4 bytes for the decoder linears, ``dtype`` for the rest.

Note: [memory]
    The skeleton is built with every parameter on the meta device (buffers such as rotary tables are
    computed on the CPU as usual, they are not in checkpoints). Tensors are then read one at a time
    with ``safetensors.safe_open`` and placed: a linear weight goes to the compute device, is quantized
    there, and only its packed bytes and quant state come back to host memory; anything else is copied
    to the CPU in ``dtype``. Shards are re-opened per decoder layer and kept tensors are copies (see
    Note: [mapped reads] in :mod:`poros_lightning.quant.cache`): the mapped file pages never exceed one
    layer's bf16 bytes, and at most one bf16 weight is alive on the device.

Note: [tied weights]
    A parameter registered under several names (``lm_head.weight`` tied to the input embedding) is
    loaded once, under its first name in module order (the embedding), as ``from_pretrained`` does;
    a checkpoint key for another of its names is ignored.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from poros_lightning.errors import PorosConfigError
from poros_lightning.quant import cache as nf4_cache
from poros_lightning.quant import check_quantization
from poros_lightning.quant.cache import layer_index
from poros_lightning.quant.skeleton import (
    LoadReport,
    Skeleton,
    _check_arch,
    _compute_device,
    _hf_config,
    _place,
    load_report,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "LoadReport",
    "checkpoint_files",
    "load_quantized",
    "load_random_quantized",
    "load_report",
    "random_checkpoint",
]

log = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"


@contextlib.contextmanager
def _progress(enabled: bool, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar in bytes with speed and ETA; silent when disabled or not on a terminal."""
    if enabled:
        from rich.console import Console

        console = Console(stderr=True)
        enabled = console.is_terminal
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True))
    with Progress(*columns, TransferSpeedColumn(), TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a model directory, in the order the loader reads them."""
    index = model_dir / _INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        raise PorosConfigError(
            f"{model_dir} has no safetensors weights (model.safetensors or {_INDEX}).",
            "Re-save the checkpoint with save_pretrained(dir) (safetensors is the default), then load that dir.",
        )
    files = [model_dir / n for n in names]
    for path in files:
        if not path.is_file():
            raise PorosConfigError(f"Shard {path} listed in {_INDEX} is missing.", "Re-download the checkpoint.")
    return files


def _load_checkpoint(sk: Skeleton, files: list[Path], device: torch.device, progress: bool) -> int:
    read = 0
    with _progress(
        progress, "quantizing" if sk.four_bit else "loading", sum(p.stat().st_size for p in files)
    ) as advance:
        for path in files:
            route: dict[str, str] = {}
            for key in nf4_cache.safetensors_keys(path):
                target = sk.target(key)
                if target:
                    route[key] = target
                elif target is None:
                    log.info("Ignoring checkpoint tensor %s: the model has no such parameter.", key)
            for f, keys in nf4_cache.iter_layers(path, route):
                for key in keys:
                    tensor = f.get_tensor(key)
                    n = _nbytes(tensor)
                    if route[key] not in sk.four_bit:  # kept: must not refer to the mapping
                        tensor = nf4_cache.private_copy(path, key, tensor)
                    _place(sk, route[key], tensor, device)
                    del tensor
                    read += n
                    advance(n)
    return read


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _random_tensor(sk: Skeleton, name: str, seed: int, device: torch.device, std: float) -> torch.Tensor:
    """Deterministic random weights: N(0, std) matrices, ones for norm vectors, zeros for other vectors.

    Linear weights (the ones that get quantized) are drawn on ``device``, everything else on the CPU,
    so the values depend on the kind of ``device`` but never on where the model is loaded.
    """
    dtype, shape = sk.specs[name]
    if len(shape) < 2:
        owner = name.split(".")[-2] if "." in name else name
        fill = torch.ones if "norm" in owner.lower() else torch.zeros
        return fill(shape, dtype=dtype)
    where = device if name in sk.linear_weights else torch.device("cpu")
    gen = torch.Generator(device=where).manual_seed(_tensor_seed(seed, name))
    return torch.empty(shape, dtype=dtype, device=where).normal_(0.0, std, generator=gen)


def _std(config: PretrainedConfig) -> float:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return float(getattr(text, "initializer_range", 0.02) or 0.02)


def _resolve_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PorosConfigError(f"{path} has no config.json.", "Pass a Hugging Face model directory.")
        return path
    if isinstance(model_dir, str) and model_dir.count("/") == 1 and not path.exists():
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model_dir, allow_patterns=["*.json", "*.safetensors"]))
        except Exception as err:
            raise PorosConfigError(
                f"Cannot fetch {model_dir!r} from the Hugging Face Hub ({type(err).__name__}: {err}).",
                "Pass a local model directory, or download it first (huggingface-cli download).",
            ) from err
    raise PorosConfigError(f"{model_dir!r} is not a model directory.", "Pass a local Hugging Face model directory.")


def load_quantized(
    model_dir: str | Path,
    *,
    quantization: str = "nf4-dq",
    compute_device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    progress: bool = True,
    allow_unlisted_arch: bool = False,
    attn_implementation: str | None = None,
    verify_cache: nf4_cache.Verification = "full",
) -> PreTrainedModel:
    """Load a safetensors checkpoint tensor by tensor, quantizing its linear layers on ``compute_device``.

    The result equals (``torch.equal`` on packed bytes and quant state) a resident
    ``from_pretrained(model_dir, quantization_config=BitsAndBytesConfig(...))`` load on the same kind
    of device, and costs host RAM close to the NF4 size (see Note: [memory]).

    Args:
        model_dir: a Hugging Face model directory with safetensors weights (or a hub id, fetched).
        quantization: one of ``poros_lightning.quant.QUANTIZATIONS``; ``"none"`` loads ``dtype`` weights.
        compute_device: where weights are quantized: CUDA when available, else the CPU.
        dtype: dtype of every unquantized tensor and of the 4-bit matmuls.
        cache_dir: NF4 cache directory (default ``$POROS_LIGHTNING_CACHE/nf4``).
        use_cache: read the quantized base from the cache when valid; write it after a fresh load.
        progress: show progress bars (bytes, speed, ETA) on a terminal.
        allow_unlisted_arch: load a ``model_type`` the architecture registry does not list.
        attn_implementation: passed to transformers (``"eager"``, ``"sdpa"``); None keeps its default.
        verify_cache: ``"full"`` checks the SHA-256 of every cache file (in threads, during the load);
            ``"quick"`` checks sizes and the first and last MiB of each file only.

    Returns:
        The causal LM in train mode, on the CPU: ``Linear4bit`` decoder linears, the rest in ``dtype``.

    Raises:
        PorosConfigError: not a safetensors model directory, or weights that do not match the config.
        UnsupportedArchitectureError: the ``model_type`` is not registered.
    """
    from transformers import AutoConfig

    check_quantization(quantization)
    if verify_cache not in ("full", "quick"):
        raise PorosConfigError(f"Unknown verify_cache {verify_cache!r}.", "Use 'full' or 'quick'.")
    source = _resolve_dir(model_dir)
    config = AutoConfig.from_pretrained(source)
    _check_arch(config, allow_unlisted_arch)
    device = _compute_device(compute_device)
    files = checkpoint_files(source)
    start = time.perf_counter()
    report = LoadReport("checkpoint", str(device), quantization, 0, 0, 0.0)
    entry = key = fingerprint = None
    if use_cache and quantization != "none":
        root = Path(cache_dir).expanduser() if cache_dir is not None else nf4_cache.default_cache_dir()
        fingerprint = nf4_cache.source_fingerprint(source, files)
        key = nf4_cache.cache_key(fingerprint, quantization=quantization, dtype=dtype, device_type=device.type)
        entry = nf4_cache.entry_dir(root, source, quantization, key)
        if entry.exists():
            sk = Skeleton(config, quantization, dtype, attn_implementation)
            bars = functools.partial(_progress, progress)
            try:
                report.bytes_read = nf4_cache.read_entry(sk, entry, key, verify_cache, bars)
                model = sk.finish(report)  # raises when a parameter is missing from the entry
            except Exception as err:  # any failure means the entry cannot be trusted
                reason = str(err) if isinstance(err, nf4_cache.CacheInvalid) else f"{type(err).__name__}: {err}"
                report.cache_rebuild_reason = reason
                warnings.warn(
                    f"NF4 cache entry {entry} is not usable ({reason}); rebuilding it from {source}.",
                    nf4_cache.CacheRebuildWarning,
                    stacklevel=2,
                )
            else:
                report.source, report.cache_entry = "cache", str(entry)
                report.quantized_layers, report.seconds = len(sk.four_bit), time.perf_counter() - start
                log.info("Loaded %s from the NF4 cache %s in %.1f s.", source, entry, report.seconds)
                return _named(model, source)
    sk = Skeleton(config, quantization, dtype, attn_implementation)
    report.bytes_read = _load_checkpoint(sk, files, device, progress)
    report.quantized_layers, report.seconds = len(sk.four_bit), time.perf_counter() - start
    log.info("Loaded %s (%d 4-bit layers, on %s) in %.1f s.", source, len(sk.four_bit), device, report.seconds)
    if entry is not None and key is not None and fingerprint is not None:
        written = time.perf_counter()
        options = {"quantization": quantization, "dtype": str(dtype), "device_type": device.type}
        if nf4_cache.write_entry(sk, config, entry, key, fingerprint, options, functools.partial(_progress, progress)):
            report.cache_entry = str(entry)
            report.cache_write_seconds = time.perf_counter() - written
    return _named(sk.finish(report), source)


def _named(model: PreTrainedModel, source: Path) -> PreTrainedModel:
    """Record where the model came from, as ``from_pretrained`` does (PEFT writes it into adapter configs)."""
    model.name_or_path = str(source)
    model.config._name_or_path = str(source)
    if (source / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(source)
    return model


def load_random_quantized(
    config: dict[str, Any] | PretrainedConfig,
    *,
    seed: int = 0,
    quantization: str = "nf4-dq",
    compute_device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    allow_unlisted_arch: bool = False,
    attn_implementation: str | None = None,
    auto_class: Any = None,
) -> PreTrainedModel:
    """Build a random-weight base tensor by tensor, without a checkpoint (for memory measurements at scale).

    The weights are those :func:`random_checkpoint` writes for the same ``config``, ``seed`` and device
    kind, so ``load_random_quantized(cfg, seed=s)`` equals ``load_quantized(random_checkpoint(cfg, d, seed=s))``.
    Arguments as in :func:`load_quantized`; ``auto_class`` is the transformers Auto class that builds the model
    (``AutoModelForCausalLM`` when None; :func:`~poros_lightning.quant.hf_config.checkpoint_auto_class` names the
    one a family's checkpoints use).
    """
    check_quantization(quantization)
    hf_config = _hf_config(config)
    _check_arch(hf_config, allow_unlisted_arch)
    device = _compute_device(compute_device)
    start = time.perf_counter()
    sk = Skeleton(hf_config, quantization, dtype, attn_implementation, auto_class)
    std = _std(hf_config)
    total = sum(dt.itemsize * math.prod(shape) for dt, shape in sk.specs.values())
    layer = None
    with _progress(progress, "generating", total) as advance:
        for name in sk.params:
            if layer_index(name) != layer:
                layer = layer_index(name)
                nf4_cache.trim_host_memory()
            tensor = _random_tensor(sk, name, seed, device, std)
            _place(sk, name, tensor, device)
            advance(_nbytes(tensor))
            del tensor
    report = LoadReport("random", str(device), quantization, len(sk.four_bit), 0, time.perf_counter() - start)
    return sk.finish(report)


def random_checkpoint(
    config: dict[str, Any] | PretrainedConfig,
    out_dir: str | Path,
    *,
    seed: int = 0,
    shard_bytes: int = 2 << 30,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
) -> Path:
    """Write a random-weight sharded safetensors checkpoint tensor by tensor (never the whole model in memory).

    Args:
        config: a config dict with ``model_type`` (or a transformers config).
        out_dir: directory to write ``config.json``, the shards and (when sharded) the index into.
        seed: weights are a function of ``seed``, the tensor name and the kind of ``device``.
        shard_bytes: target shard size; a shard is cut only between decoder layers.
        device: where linear weights are drawn (CUDA when available, else the CPU).
        dtype: dtype of every tensor.
        progress: show a progress bar on a terminal.

    Returns:
        ``out_dir``; ``config.json`` is written last, so its presence marks a complete checkpoint.
    """
    from poros_lightning.quant.cache import TensorSpec, plan_shards, shard_name, write_safetensors

    hf_config = _hf_config(config)
    device = _compute_device(device)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    sk = Skeleton(hf_config, "none", dtype, None)
    specs = [TensorSpec(n, *sk.specs[n]) for n in sk.params]
    shards = plan_shards(specs, [layer_index(n) for n in sk.params], shard_bytes)
    std = _std(hf_config)
    weight_map: dict[str, str] = {}
    with _progress(progress, "writing", sum(s.nbytes for s in specs)) as advance:
        for i, shard in enumerate(shards):
            file = shard_name(i, len(shards))

            def tensors(shard: list[TensorSpec] = shard) -> Iterator[torch.Tensor]:
                for spec in shard:
                    yield _random_tensor(sk, spec.name, seed, device, std)
                    advance(spec.nbytes)

            write_safetensors(out / file, shard, tensors(), {"format": "pt"})
            weight_map.update({spec.name: file for spec in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
        (out / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    hf_config.dtype = dtype
    hf_config.save_pretrained(out)
    return out
