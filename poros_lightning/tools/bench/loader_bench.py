"""Loader measurement: peak host RSS, loader VRAM peak and wall time of the streamed NF4 loader.

    python -m poros_lightning.tools.bench.loader_bench --config Qwen/Qwen2.5-7B --write-checkpoint /tmp/qwen2.5-7b \\
        --cache-dir /tmp/nf4-cache --compare-resident --out docs/benchmarks/loader.jsonl
    python -m poros_lightning.tools.bench.loader_bench --config Qwen/Qwen2.5-72B --generate --out docs/benchmarks/loader.jsonl

Each measurement runs in a fresh child process, so its peak RSS (sampled with psutil and read from
``getrusage``) belongs to that load alone; the parent appends one JSON line per measurement to ``--out``.
Modes: ``write`` (the random checkpoint, written once), ``checkpoint`` (load it, no cache),
``cache-build`` and ``cache-hit`` (with ``--cache-dir``), ``compare`` (``--compare-resident``: byte
identity against a resident ``from_pretrained(..., BitsAndBytesConfig(nf4))`` load on the GPU), and
``generate`` (weights drawn tensor by tensor, no disk; for sizes whose checkpoint would not fit).

Goals recorded with every row: peak host RSS <= 1.15 x (NF4 base + bf16 resident modules) + 1.5 GB
(GB = 1e9 bytes) and loader VRAM peak <= 2 decoder layers in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RSS_FACTOR = 1.15
RSS_SLACK = 1.5e9
VRAM_LAYERS = 2
_MARKER = ".poros-random-checkpoint.json"


class RssSampler:
    """Peak resident set size of this process, sampled every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = 0.005) -> None:
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(self._interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def _sizes(model: Any) -> dict[str, int]:
    """NF4 base bytes (everything under the decoder layers), resident bytes (the rest), one layer in bf16."""
    from poros_lightning.arch import arch_for_model, resolve
    from poros_lightning.quant import is_4bit_linear

    spec = arch_for_model(model, allow_unlisted=True)
    seen: set[int] = set()
    base = resident = 0
    tensors = list(model.state_dict().items()) + [(n, b) for n, b in model.named_buffers()]
    for name, t in tensors:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        n = t.numel() * t.element_size()
        if name.startswith(spec.layers + "."):
            base += n
        else:
            resident += n
    layer_bf16 = 0
    for module in resolve(model, spec.layers)[0].modules():
        for pname, p in module.named_parameters(recurse=False):
            shape = module.weight.quant_state.shape if is_4bit_linear(module) and pname == "weight" else p.shape
            layer_bf16 += 2 * int(_numel(shape))
    return {"nf4_base_bytes": base, "resident_bytes": resident, "layer_bf16_bytes": layer_bf16}


def _numel(shape: Any) -> int:
    n = 1
    for dim in shape:
        n *= int(dim)
    return n


def _host_ram() -> int:
    import psutil

    return psutil.virtual_memory().total


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "bitsandbytes", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    return out


def _compare(model: Any, checkpoint: Path, device: str) -> dict[str, Any]:
    """torch.equal on every state-dict entry against a resident bitsandbytes load on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    ref = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.bfloat16, quantization_config=bnb_config, device_map=device
    )
    a, b = model.state_dict(), ref.state_dict()
    keys = sorted(set(a) | set(b))
    unequal = [k for k in keys if k not in a or k not in b or not torch.equal(a[k], b[k].cpu())]
    return {"byte_identical": not unequal, "tensors_compared": len(keys), "unequal": unequal[:20]}


def _child(mode: str, args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """One measurement in this (fresh) process."""
    import torch
    import transformers  # noqa: F401  (imported before the clock starts, as is bitsandbytes: not loading costs)

    from poros_lightning.quant import bnb
    from poros_lightning.quant.loader import load_quantized, load_random_quantized, load_report, random_checkpoint

    bnb()

    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = args.device if cuda else "cpu"
    if cuda:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    baseline = RssSampler().peak
    start = time.perf_counter()
    model = None
    with RssSampler() as rss:
        if mode == "write":
            random_checkpoint(
                config, args.write_checkpoint, seed=args.seed, shard_bytes=args.shard_bytes, device=device
            )
        elif mode == "generate":
            model = load_random_quantized(config, seed=args.seed, quantization=args.quantization, compute_device=device)
        else:
            use_cache = mode in ("cache-build", "cache-hit")
            model = load_quantized(
                args.write_checkpoint,
                quantization=args.quantization,
                compute_device=device,
                cache_dir=args.cache_dir,
                use_cache=use_cache,
                progress=False,
            )
    wall = time.perf_counter() - start
    row: dict[str, Any] = {
        "model": args.config,
        "mode": mode,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        **_versions(),
        "quantization": args.quantization,
        "seed": args.seed,
        "wall_s": round(wall, 3),
        "baseline_rss_bytes": baseline,
        "peak_rss_sampled_bytes": rss.peak,
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "vram_peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "vram_reserved_peak_bytes": torch.cuda.max_memory_reserved() if cuda else 0,
        "host_ram_bytes": _host_ram(),
    }
    row["peak_rss_bytes"] = max(row["peak_rss_sampled_bytes"], row["ru_maxrss_bytes"])
    if mode == "write":
        files = list(Path(args.write_checkpoint).glob("*.safetensors"))
        row["checkpoint_bytes"] = sum(p.stat().st_size for p in files)
        return row
    report = load_report(model)
    row.update(
        {
            "source": report.source,
            "bytes_read": report.bytes_read,
            "cache_write_s": report.cache_write_seconds,
            "cache_rebuild_reason": report.cache_rebuild_reason,
            **_sizes(model),
        }
    )
    row["rss_goal_bytes"] = int(RSS_FACTOR * (row["nf4_base_bytes"] + row["resident_bytes"]) + RSS_SLACK)
    row["vram_goal_bytes"] = VRAM_LAYERS * row["layer_bf16_bytes"]
    row["rss_ok"] = row["peak_rss_bytes"] <= row["rss_goal_bytes"]
    row["vram_ok"] = row["vram_peak_bytes"] <= row["vram_goal_bytes"]
    row["pass"] = row["rss_ok"] and row["vram_ok"] and (mode != "cache-hit" or report.source == "cache")
    if mode == "compare":
        row.update(_compare(model, Path(args.write_checkpoint), device))
        row["pass"] = row["pass"] and row["byte_identical"]
    return row


def _run_child(mode: str, argv: list[str]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = Path(tmp.name)
    try:
        cmd = [
            sys.executable,
            "-m",
            "poros_lightning.tools.bench.loader_bench",
            *argv,
            "--child",
            mode,
            "--row-out",
            str(out),
        ]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


def _discard_cache_entry(args: argparse.Namespace) -> None:
    """Remove this checkpoint's cache entry, so ``cache-build`` really quantizes and writes it."""
    import torch

    from poros_lightning.quant import cache as nf4_cache
    from poros_lightning.quant.loader import checkpoint_files

    source = Path(args.write_checkpoint)
    fingerprint = nf4_cache.source_fingerprint(source, checkpoint_files(source))
    kind = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    key = nf4_cache.cache_key(fingerprint, quantization=args.quantization, dtype=torch.bfloat16, device_type=kind)
    nf4_cache.discard(nf4_cache.entry_dir(Path(args.cache_dir), source, args.quantization, key))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m poros_lightning.tools.bench.loader_bench", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", required=True, help="hub id (bundled config facts) or config.json / model dir")
    p.add_argument("--out", required=True, type=Path, help="JSONL file to append rows to")
    p.add_argument("--write-checkpoint", metavar="DIR", help="write (once) and load a random-weight checkpoint")
    p.add_argument("--generate", action="store_true", help="draw weights tensor by tensor instead (no disk)")
    p.add_argument("--cache-dir", help="also measure building and hitting the NF4 cache in this directory")
    p.add_argument("--compare-resident", action="store_true", help="byte identity vs a resident bnb GPU load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quantization", default="nf4-dq")
    p.add_argument("--shard-bytes", type=int, default=2 << 30)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    from poros_lightning.tools.check import load_config

    config, _ = load_config(args.config)
    if args.child:
        row = _child(args.child, args, config)
        Path(args.row_out).write_text(json.dumps(row))
        return 0
    if args.generate == bool(args.write_checkpoint):
        raise SystemExit("pass exactly one of --generate and --write-checkpoint DIR")
    rows: list[dict[str, Any]] = []

    def measure(mode: str) -> None:
        row = _run_child(mode, argv)
        rows.append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:  # one line as soon as it is measured
            f.write(json.dumps(row, sort_keys=True) + "\n")
        print(_summary(row), flush=True)

    if args.generate:
        measure("generate")
    else:
        ckpt = Path(args.write_checkpoint)
        marker = json.loads(json.dumps({"config": config, "seed": args.seed, "device": args.device}))
        if not (ckpt / _MARKER).is_file():
            measure("write")
            (ckpt / _MARKER).write_text(json.dumps(marker, sort_keys=True))
        elif json.loads((ckpt / _MARKER).read_text()) != marker:
            raise SystemExit(f"{ckpt} holds a random checkpoint of another config, seed or device; pass another DIR")
        measure("checkpoint")
        if args.cache_dir:
            _discard_cache_entry(args)
            measure("cache-build")
            measure("cache-hit")
        if args.compare_resident:
            measure("compare")
    return 0 if all(row.get("pass", True) for row in rows) else 1


def _summary(row: dict[str, Any]) -> str:
    parts = [f"{row['model']} {row['mode']:>11}: {row['wall_s']:8.1f} s"]
    parts.append(f"peak RSS {row['peak_rss_bytes'] / 1e9:6.2f} GB")
    if "rss_goal_bytes" in row:
        parts.append(f"(goal {row['rss_goal_bytes'] / 1e9:.2f})")
    parts.append(f"VRAM peak {row['vram_peak_bytes'] / 1e9:6.2f} GB")
    if "vram_goal_bytes" in row:
        parts.append(f"(goal {row['vram_goal_bytes'] / 1e9:.2f})")
    if "byte_identical" in row:
        parts.append(f"byte-identical {row['byte_identical']}")
    if "pass" in row:
        parts.append("PASS" if row["pass"] else "FAIL")
    return "  ".join(parts)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
