"""Peak host RSS and wall time of ``poros-lightning export`` on a random-init checkpoint of a published config.

Writes a bf16 checkpoint of the config (random weights, 2 GB shards, built shard by shard so this script
never holds the model) and a LoRA adapter (r=16, alpha=32, every linear layer of the decoder, random
non-zero factors) once under ``--workdir``, then runs the export in a fresh process and prints one JSON
line: the export's own ``ExportResult`` plus the peak RSS of a process that only imports the exporter.

Usage (the command is recorded in each line):

    python -m poros_lightning.tools.bench.export_bench Qwen/Qwen2.5-7B --workdir /tmp/export-bench >> docs/benchmarks/export.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]  # the checkout: the measured child process imports from it


def _write_base(hub_id: str, path: Path, shard_bytes: int = 2 * 10**9) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from poros_lightning.arch.known import known_config

    cfg = dict(known_config(hub_id))
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg, dtype="bfloat16")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, weight_map, files = 0, {}, []

    def flush() -> None:
        name = f"part-{len(files):05d}.safetensors"
        save_file(shards[-1], str(tmp / name), metadata={"format": "pt"})
        files.append((name, list(shards[-1])))
        shards[-1] = {}

    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied to the embedding, as save_pretrained writes it
        nbytes = param.numel() * 2
        if shards[-1] and size + nbytes > shard_bytes:
            flush()
            size = 0
        if param.dim() == 1:
            shards[-1][name] = torch.ones(param.shape, dtype=torch.bfloat16)
        else:
            shards[-1][name] = (torch.randn(param.shape, generator=gen) * 0.02).to(torch.bfloat16)
        size += nbytes
    flush()
    for i, (name, keys) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (tmp / name).rename(tmp / final)
        weight_map.update(dict.fromkeys(keys, final))
    total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(tmp)
    tmp.rename(path)


def _write_adapter(base: Path, path: Path, r: int = 16) -> None:
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from poros_lightning.arch import get_arch
    from poros_lightning.training.adapter import TrainingInfo

    config = AutoConfig.from_pretrained(base)
    targets = list(get_arch(config.model_type).lora_targets)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            a = torch.randn(r, module.in_features, generator=gen) * 0.01
            b = torch.randn(module.out_features, r, generator=gen) * 0.01
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, base_model_name_or_path=str(base)).save_pretrained(path)
    TrainingInfo().write(path)


@torch.no_grad()
def _verify(base: Path, adapter: Path, merged: Path) -> dict[str, float]:
    """Logits of the merged checkpoint against the NF4 base with the adapter attached, on 32 random tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from poros_lightning.quant import quantize_model

    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    got = model(input_ids=ids).logits.float()
    del model
    resident = quantize_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), "nf4-dq")
    ref = PeftModel.from_pretrained(resident, adapter).eval()(input_ids=ids).logits.float()
    return {
        "max_abs_logit_diff": (got - ref).abs().max().item(),
        "mean_abs_logit_diff": (got - ref).abs().mean().item(),
        "max_abs_logit": ref.abs().max().item(),
        "argmax_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="hub id of a config in poros_lightning/arch/known_configs.json")
    parser.add_argument("--workdir", default="/tmp/export-bench")
    parser.add_argument("--merge-into", default="nf4", choices=("nf4", "original"))
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--keep-output", action="store_true", help="keep the merged checkpoint")
    parser.add_argument("--verify", action="store_true", help="compare merged logits with the adapter model's")
    args = parser.parse_args()
    work = Path(args.workdir) / args.model.replace("/", "--")
    base, adapter, out = work / "base", work / "adapter", work / "merged"
    if not base.is_dir():
        _write_base(args.model, base)
    if not adapter.is_dir():
        _write_adapter(base, adapter)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    probe = "from poros_lightning.tools.export import peak_rss_bytes; print(peak_rss_bytes())"
    import_rss = int(subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout)
    cmd = [sys.executable, "-m", "poros_lightning.tools.export_cli", str(adapter), "--base", str(base), "-o", str(out)]
    cmd += ["--merge-into", args.merge_into, "--dtype", args.dtype, "--max-shard-size", args.max_shard_size]
    done = subprocess.run([*cmd, "--force", "--no-progress", "--json"], env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    checkpoint = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    record = {
        "model": f"{args.model} (random init)",
        "checkpoint_gb": checkpoint / 1e9,
        "lora_r": 16,
        "merge_into": args.merge_into,
        "dtype": result["dtype"],
        "max_shard_size": args.max_shard_size,
        "seconds": result["seconds"],
        "peak_rss_gib": result["peak_rss_bytes"] / 2**30,
        "import_only_rss_gib": import_rss / 2**30,
        "merged": result["merged"],
        "requantized": result["requantized"],
        "tensors": result["tensors"],
        "shards": result["shards"],
        "output_gb": result["total_bytes"] / 1e9,
        "cpus": os.cpu_count(),
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "bitsandbytes": version("bitsandbytes"),
        "command": "python -m poros_lightning.tools.bench.export_bench " + " ".join(sys.argv[1:]),
    }
    if args.verify:
        record["verify"] = _verify(base, adapter, out)
    if not args.keep_output:
        import shutil

        shutil.rmtree(out)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
