"""``poros-lightning parity --config X.yaml``: the resident-vs-streamed gate from a YAML file.

The YAML names a model (a bundled hub id, a local directory or a ``config.json``; weights are
random-init from the config, which is what parity needs), the modes and block sizes to gate, the
shapes and the JSONL output. Exit status 0 only when every surface of every run is equal.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import yaml

from poros_lightning.errors import PorosConfigError

__all__ = ["main", "load_parity_config"]

MODES = (
    "plain",
    "dropout",
    "accum",
    "block_major",
    "block_major_dropout",
    "compile",
    "min_memory",
    "keep_activations",
    "resident_blocks",
    "replan",
)
_KEYS = {
    "model",
    "model_config",
    "scale",
    "steps",
    "modes",
    "block_sizes",
    "seq_len",
    "lora_r",
    "batch_size",
    "out",
    "build",
    "text_only",
    "accumulate",
}
BUILDS = {"auto": None, "direct": False, "blockwise": True}


def load_parity_config(path: str | Path) -> dict[str, Any]:
    """Read and validate a parity YAML file: a path, or a shipped parity config's name (``qwen2.5-7b``)."""
    from poros_lightning.training.assets.configs import resolve_config

    path = resolve_config(path, "parity")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise PorosConfigError(f"Cannot read parity config {str(path)!r}: {err}", "Pass a readable YAML file.") from err
    unknown = set(raw) - _KEYS
    if unknown:
        raise PorosConfigError(
            f"Unknown keys in {path}: {', '.join(sorted(unknown))}.", f"Allowed keys: {', '.join(sorted(_KEYS))}."
        )
    if "model" not in raw and "model_config" not in raw:
        raise PorosConfigError(f"{path} names no model.", "Add `model: Qwen/Qwen2.5-7B` (or `model_config: {...}`).")
    model_config = raw.get("model_config")
    if model_config is not None and not (
        isinstance(model_config, dict) and isinstance(model_config.get("model_type"), str)
    ):
        raise PorosConfigError(
            f"model_config in {path} needs a 'model_type' string.",
            "Write `model_config: {model_type: qwen2, ...}` with the keys of that family's config.json.",
        )
    bad = [m for m in raw.get("modes", ["plain"]) if m not in MODES]
    if bad:
        raise PorosConfigError(f"Unknown parity modes {bad} in {path}.", f"Use modes from {', '.join(MODES)}.")
    if raw.get("build", "auto") not in BUILDS:
        raise PorosConfigError(
            f"Unknown build {raw['build']!r} in {path}.",
            "Use build: auto (blockwise when bf16 weights would not fit), direct or blockwise.",
        )
    return raw


def text_only(config: dict[str, Any], name: str) -> tuple[dict[str, Any], str]:
    """The text decoder of a multimodal config as a config of its own (``gemma3`` -> ``gemma3_text``).

    The text model is a registered family of its own (``Gemma3ForCausalLM`` for ``gemma3_text``); ``text_only:
    true`` gates it at the multimodal checkpoint's shapes.
    """
    from poros_lightning.quant.hf_config import hf_config

    text = config.get("text_config")
    if not isinstance(text, dict):
        raise PorosConfigError(
            f"text_only: true needs a multimodal config with a text_config; {name} ({config.get('model_type')}) has none.",
            "Leave text_only out for a text model, or name a multimodal checkpoint (google/gemma-3-27b-it).",
        )
    text = {"model_type": hf_config(config).get_text_config().model_type, **text}
    if "tie_word_embeddings" in config and "tie_word_embeddings" not in text:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text, f"{name} (text model)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="poros-lightning parity", description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        required=True,
        help="parity YAML: a path, or a shipped config's name (e.g. qwen2.5-7b, see configs/parity/)",
    )
    p.add_argument("--steps", type=int, help="optimizer steps per run (overrides the YAML)")
    p.add_argument("--modes", nargs="+", choices=MODES, help="modes to gate (overrides the YAML)")
    p.add_argument("--block-sizes", type=int, nargs="+", help="block sizes to gate (overrides the YAML)")
    p.add_argument("--out", help="JSONL file to append to (overrides the YAML)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the gates of a parity YAML; returns 0 only when everything is equal."""
    args = _parser().parse_args(argv)
    cfg = load_parity_config(args.config)
    if "model_config" in cfg:
        model_config, name = dict(cfg["model_config"]), cfg.get("model", cfg["model_config"]["model_type"])
    else:
        from poros_lightning.tools.check import load_config

        model_config, _ = load_config(cfg["model"])
        name = cfg["model"]
    if cfg.get("text_only"):
        model_config, name = text_only(model_config, name)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from poros_lightning.tools.parity.runner import run_parity

    steps = args.steps or int(cfg.get("steps", 10))
    out = args.out or cfg.get("out")
    ok = True
    for mode in args.modes or cfg.get("modes", ["plain"]):
        for block_size in args.block_sizes or cfg.get("block_sizes", [1]):
            result = run_parity(
                model_config,
                model=f"{name} (random init)",
                scale=str(cfg.get("scale", "")),
                steps=steps,
                mode=mode,
                block_size=block_size,
                seq_len=int(cfg.get("seq_len", 512)),
                batch_size=int(cfg.get("batch_size", 1)),
                lora_r=int(cfg.get("lora_r", 16)),
                out=out,
                blockwise=BUILDS[cfg.get("build", "auto")],
                accumulate=int(cfg["accumulate"]) if "accumulate" in cfg else None,
            )
            verdict = "EQUAL" if result.equal else f"MISMATCH at {result.first_mismatch}"
            surfaces = " ".join(f"{k}={'ok' if v else 'DIFF'}" for k, v in result.surfaces.items())
            print(f"{name} mode={mode} block_size={block_size} steps={steps}: {verdict} ({surfaces})", flush=True)
            ok &= result.equal
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
