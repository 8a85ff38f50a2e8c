"""``poros-lightning export``: merge a LoRA adapter into its base and write a Hugging Face checkpoint.

Invariant: host memory stays bounded by one tensor's working set, whatever the model size. The base
is read tensor by tensor with positioned reads from its safetensors files (no memory map, so nothing
accumulates in the resident set); every output shard's header is planned up front from the input
headers, and each tensor is written into its shard as soon as it is computed.

Note: [what "nf4" merges into]
    The adapter was trained against the *dequantized* quantized base, not the original weights. The
    default ``merge_into="nf4"`` rebuilds exactly that: each linear weight the training run quantized
    is cast to the compute dtype, quantized with bitsandbytes' ``quantize_4bit`` using the settings of
    the run (``poros_training.json`` next to the adapter; NF4 + double quantization, blocksize 64, when
    the file is absent) and dequantized with ``dequantize_4bit`` -- the same calls and bytes the 4-bit
    layers used. Every such weight changes, targeted by LoRA or not. ``merge_into="original"`` adds the
    update to the checkpoint's own weights instead. The update ``scaling * B @ A`` is added in float32 and
    the sum is cast once to the output dtype.
"""

from __future__ import annotations

import json
import re
import resource
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from poros_lightning import quant
from poros_lightning.errors import PorosConfigError
from poros_lightning.tools.export_spec import MERGE_INTO
from poros_lightning.tools.safetensors_files import (
    ShardWriter,
    TensorEntry,
    base_tensors,
    check_match,
    finish_out,
    linear_modules,
    module_of,
    numel,
    parse_size,
    prepare_out,
    read_into,
    read_tensor,
    resolve_base,
)
from poros_lightning.training.adapter import TRAINING_INFO, LoraFactors, TrainingInfo, read_lora

__all__ = ["DTYPES", "MERGE_INTO", "ExportResult", "export", "format_result", "parse_size", "peak_rss_bytes"]


DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
"""Output dtype names accepted by :func:`export` (floating tensors are cast to it; others are copied)."""

_COPIED = ("generation_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt")
_COPIED_GLOBS = ("tokenizer*", "chat_template*", "*.tiktoken", "vocab.txt", "spiece.model")
_CHUNK = 64 << 20  # bytes per read when a tensor passes through unchanged


# ------------------------------------------------------------------------------------------ export


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export` wrote.

    Attributes:
        out_dir: the merged checkpoint directory.
        base: the base as given.
        adapter_dir: the adapter directory.
        merge_into: ``"nf4"`` or ``"original"``.
        dtype: output dtype name.
        device: where the ``"nf4"`` quantize/dequantize ran.
        training: the quantization settings used for ``"nf4"`` (read from ``poros_training.json`` or defaults).
        training_info_found: whether ``poros_training.json`` was present.
        merged: linear weights that received a LoRA update.
        requantized: linear weights replaced by their quantized-then-dequantized form (``"nf4"`` only).
        tensors: tensors written.
        shards: safetensors files written.
        total_bytes: bytes of tensor data written.
        seconds: wall time of the export.
        peak_rss_bytes: peak resident set size of this process so far (imports included).
    """

    out_dir: Path
    base: str
    adapter_dir: Path
    merge_into: str
    dtype: str
    device: str
    training: TrainingInfo
    training_info_found: bool
    merged: int
    requantized: int
    tensors: int
    shards: int
    total_bytes: int
    seconds: float
    peak_rss_bytes: int = field(default=0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = asdict(self)
        out.update(out_dir=str(self.out_dir), adapter_dir=str(self.adapter_dir))
        out["training"]["unquantized"] = list(self.training.unquantized)
        return out


def _base_weight(w: torch.Tensor, info: TrainingInfo, quantized: bool, device: torch.device) -> torch.Tensor:
    """The weight as the training run's forward saw it (see Note: [what "nf4" merges into])."""
    w = w.to(DTYPES[info.compute_dtype])
    if not quantized:
        return w
    functional = quant.bnb().functional
    packed, state = functional.quantize_4bit(
        w.to(device).contiguous(),
        blocksize=info.blocksize,
        compress_statistics=info.quantization.endswith("-dq"),
        quant_type=info.quantization.split("-")[0],
        quant_storage=torch.uint8,
    )
    return functional.dequantize_4bit(packed, state).cpu()


def _copy(f: Any, t: TensorEntry, dtype: torch.dtype, writer: ShardWriter) -> None:
    """Copy (and cast) a tensor in bounded chunks."""
    step = max(_CHUNK // t.dtype.itemsize, 1)
    count = numel(t.shape)
    for start in range(0, count, step):
        chunk = torch.empty(min(step, count - start), dtype=t.dtype)
        read_into(f, t.offset + start * t.dtype.itemsize, chunk)
        writer.write(chunk.to(dtype))


def _plan_shards(
    sources: list[TensorEntry], out_dtype: torch.dtype, max_bytes: int
) -> list[list[tuple[TensorEntry, torch.dtype]]]:
    shards: list[list[tuple[TensorEntry, torch.dtype]]] = [[]]
    size = 0
    for t in sources:
        dtype = out_dtype if t.dtype.is_floating_point else t.dtype
        nbytes = numel(t.shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((t, dtype))
        size += nbytes
    return shards


def _progress(enabled: bool, total: int) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    bar = Progress(*columns, console=Console(stderr=True), disable=not enabled)
    bar.add_task("merging", total=total)
    return bar


def _model_card(result: ExportResult, adapter_config: dict[str, Any], loras: dict[str, LoraFactors]) -> str:
    info = result.training
    if result.merge_into == "nf4":
        into = (
            f"the base as the adapter was trained against it: each linear weight quantized ({info.quantization}, "
            f"blocksize {info.blocksize}, from {info.compute_dtype}) and dequantized again with bitsandbytes, "
            "so the merged weights carry the quantization error the adapter learned to compensate"
        )
        if info.quantization == "none":
            into = f"the base weights in {info.compute_dtype}, as the adapter was trained against them"
    else:
        into = "the original base weights (not the quantized ones the adapter was trained against)"
    ranks = sorted({lora.a.shape[0] for lora in loras.values()})
    return (
        "---\n"
        f"base_model: {result.base}\n"
        "library_name: transformers\n"
        "tags: [poros-lightning, lora, merged]\n"
        "---\n\n"
        f"# {result.out_dir.name}\n\n"
        f"A LoRA adapter merged into its base with `poros-lightning export`.\n\n"
        f"- Base: `{result.base}`\n"
        f"- Adapter: `{result.adapter_dir.name}` (LoRA r={'/'.join(map(str, ranks))}, "
        f"alpha={adapter_config.get('lora_alpha')}, rslora={bool(adapter_config.get('use_rslora'))}, "
        f"{result.merged} linear layers)\n"
        f"- Merged into: {into} (`--merge-into {result.merge_into}`)\n"
        f"- Weights: {result.dtype}, {result.tensors} tensors in {result.shards} safetensors file(s)\n\n"
        "Each merged weight is `W + scaling * B @ A`, added in float32 and rounded once to the output dtype. "
        "The merged model is therefore close to, not bitwise equal to, the base with the adapter attached: "
        "that model computes the base and the adapter products apart and rounds each. See docs/interop.md "
        "of poros-lightning for the measured tolerance.\n"
    )


def _write_side_files(tmp: Path, base_dir: Path, adapter_dir: Path, dtype: torch.dtype) -> None:
    config = json.loads((base_dir / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    config["torch_dtype"] = name  # read by serving engines that predate transformers 5
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for source in (base_dir, adapter_dir):  # tokenizer files saved with the adapter win
        names = {p.name for g in _COPIED_GLOBS for p in source.glob(g)} | {n for n in _COPIED if (source / n).is_file()}
        for n in sorted(names):
            if (source / n).is_file():
                shutil.copyfile(source / n, tmp / n)


def export(
    adapter_dir: str | Path,
    base: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "bf16",
    merge_into: str = "nf4",
    max_shard_size: str | int = "2GB",
    progress: bool = True,
    force: bool = False,
    device: str | torch.device | None = None,
) -> ExportResult:
    """Merge a PEFT LoRA adapter into its base and write a sharded safetensors Hugging Face checkpoint.

    The output loads with ``AutoModelForCausalLM.from_pretrained`` and serving engines: safetensors
    shards (``model.safetensors.index.json`` when there are several), ``config.json`` with the output
    dtype, generation and tokenizer files copied from the base (those saved with the adapter win), and a
    ``README.md`` model card naming the base, the adapter and the merge mode. It is written into
    ``<out_dir>.tmp`` and renamed into place at the end.

    Args:
        adapter_dir: a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).
        base: the base model: a local Hugging Face directory, or a hub id already in the local cache.
        out_dir: where to write the merged checkpoint.
        dtype: output dtype of floating tensors: ``bf16``, ``fp16`` or ``fp32``.
        merge_into: ``"nf4"`` (default): the quantized-then-dequantized base the adapter was trained
            against; ``"original"``: the base checkpoint's own weights.
        max_shard_size: largest safetensors file, e.g. ``"2GB"``.
        progress: show a progress bar (rich, on stderr).
        force: replace an existing non-empty ``out_dir``.
        device: where ``"nf4"`` runs bitsandbytes' quantize/dequantize; by default the device type the
            training run quantized on when ``poros_training.json`` records it and this machine has one,
            else the CPU (bitsandbytes' CPU and CUDA kernels may round values on a code boundary apart).

    Returns:
        An :class:`ExportResult`.

    Raises:
        PorosConfigError: missing or unsupported adapter files, an adapter that does not fit the base, an
            existing output without ``force``, bad options, or too little disk space.
    """
    start = time.perf_counter()
    if dtype not in DTYPES:
        raise PorosConfigError(f"Unknown output dtype {dtype!r}.", f"Use one of {', '.join(DTYPES)}.")
    if merge_into not in MERGE_INTO:
        raise PorosConfigError(f"Unknown merge_into {merge_into!r}.", f"Use one of {', '.join(MERGE_INTO)}.")
    out_dtype, max_bytes = DTYPES[dtype], parse_size(max_shard_size)
    adapter_path, out = Path(adapter_dir).expanduser(), Path(out_dir).expanduser()
    adapter_config, loras = read_lora(adapter_path)
    base_dir = resolve_base(base)
    if "quantization_config" in json.loads((base_dir / "config.json").read_text()):
        raise PorosConfigError(
            f"The base {base_dir} is a quantized checkpoint; export needs the unquantized weights.",
            "Pass the original (bf16/fp16/fp32) checkpoint the quantized one was made from.",
        )
    sources = base_tensors(base_dir)
    lora_of = {t.name: m for t in sources if (m := module_of(t.name, loras)) is not None}
    check_match(loras, {m: t for t in sources if (m := lora_of.get(t.name))}, adapter_config)
    found = TrainingInfo.read(adapter_path)
    info = found or TrainingInfo()
    requant: set[str] = set()
    if merge_into == "nf4" and info.quantization != "none":
        linear = linear_modules(base_dir)
        requant = {t.name for t in sources if (m := module_of(t.name, linear)) is not None and info.quantizes(m)}
    if device is None:
        on = info.quantized_on
        device = on if on == "cpu" or (on == "cuda" and torch.cuda.is_available()) else "cpu"
    device = torch.device(device)
    shards = _plan_shards(sources, out_dtype, max_bytes)
    total = sum(numel(t.shape) * d.itemsize for shard in shards for t, d in shard)
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path.cwd()).free
    if free < total:
        raise PorosConfigError(
            f"The merged checkpoint needs {total / 1e9:.1f} GB but {out.parent} has {free / 1e9:.1f} GB free.",
            "Free some space or write it elsewhere (-o).",
        )
    tmp = prepare_out(out, force)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    files = {path: path.open("rb") for path in {t.path for t in sources}}
    try:
        with _progress(progress, total) as bar:
            for name, shard in zip(names, shards, strict=True):
                writer = ShardWriter(tmp / name, [(t.name, d, t.shape) for t, d in shard])
                for t, d in shard:
                    lora = loras[lora_of[t.name]] if t.name in lora_of else None
                    if lora is None and t.name not in requant:
                        _copy(files[t.path], t, d, writer)
                    else:
                        w = read_tensor(files[t.path], t)
                        if merge_into == "nf4":
                            w = _base_weight(w, info, t.name in requant, device)
                        writer.write((w.float() + lora.delta() if lora is not None else w).to(d))
                    layer = re.search(r"layers\.(\d+)\.", t.name)
                    label = f"layer {layer.group(1)}" if layer else t.name
                    bar.update(bar.task_ids[0], advance=numel(t.shape) * d.itemsize, description=label)
                writer.close()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written checkpoint behind
        raise
    finally:
        for f in files.values():
            f.close()
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {t.name: n for n, s in zip(names, shards, strict=True) for t, _ in s},
        }
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _write_side_files(tmp, base_dir, adapter_path, out_dtype)
    result = ExportResult(
        out_dir=out,
        base=str(base),
        adapter_dir=adapter_path,
        merge_into=merge_into,
        dtype=str(out_dtype).removeprefix("torch."),
        device=str(device),
        training=info,
        training_info_found=found is not None,
        merged=len(loras),
        requantized=len(requant),
        tensors=len(sources),
        shards=len(shards),
        total_bytes=total,
        seconds=time.perf_counter() - start,
        peak_rss_bytes=peak_rss_bytes(),
    )
    (tmp / "README.md").write_text(_model_card(result, adapter_config, loras))
    finish_out(tmp, out)
    return result


def peak_rss_bytes() -> int:
    """Peak resident set size of this process's address space (``VmHWM``; ``getrusage`` off Linux).

    ``getrusage``'s ``ru_maxrss`` survives ``exec`` on Linux, so a child would report its parent's peak.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def format_result(result: ExportResult) -> str:
    """A short human summary of an export."""
    info = result.training
    into = f"dequantized {info.quantization} base" if result.merge_into == "nf4" else "original base weights"
    note = (
        "" if result.training_info_found or result.merge_into == "original" else f" ({TRAINING_INFO} absent: assumed)"
    )
    return (
        f"Merged {result.merged} LoRA layers into the {into}{note}.\n"
        f"Wrote {result.out_dir}: {result.tensors} tensors, {result.total_bytes / 1e9:.2f} GB {result.dtype} in "
        f"{result.shards} file(s), {result.seconds:.1f} s, peak host RSS {result.peak_rss_bytes / 2**30:.2f} GiB."
    )
