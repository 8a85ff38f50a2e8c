"""The child's side of a peer run: one peer, loaded and trained the way its users do it, timed as the bench times.

Each runner loads the checkpoint of :func:`~poros_lightning.tools.bench.peers.write_checkpoint` with the peer's own
loader, puts LoRA (rank ``lora_r``, alpha ``2 * lora_r``, dropout 0) on every linear layer of the decoder, and trains
on :func:`~poros_lightning.tools.bench.peers.bench_batches` with AdamW (lr 1e-4): ``warmup`` untimed steps, then
``steps`` timed ones, each synchronized before and after, each one optimizer update over ``accumulate`` micro-batches
of ``batch_size`` rows. Peak device memory (allocated and reserved) counts from the first step on. The parent
(:func:`~poros_lightning.tools.bench.peers.run_peer`) starts ``python -m poros_lightning.tools.bench.peer_runners
run-one --spec SPEC.json --row ROW.json`` in the run's work directory and reads the row back.

Note: [import order]
    Unsloth patches transformers and peft as they are imported, so nothing here imports either at module level:
    a runner imports its peer first. The versions are read after training.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from poros_lightning.tools.bench.peers import PEER_PACKAGES, bench_batches, peer_row

__all__ = ["main", "run_one"]

_VERSIONS = {"hf_offload": ("transformers", "bitsandbytes", "peft"), "unsloth": ("unsloth",), "soup": ("soup-cli",)}
_HINT = "carry the peer wheels of poros_lightning/tools/bench/peer_wheels.sh (docs/benchmarks.md, Peers)"


class PeerRefusal(RuntimeError):
    """The peer cannot run here (a package or CUDA missing): a refused row, not a crash."""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peaks() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peaks() -> dict[str, float | None]:
    if not torch.cuda.is_available():
        return {"peak_vram_gb": None, "peak_reserved_gb": None}
    return {
        "peak_vram_gb": torch.cuda.max_memory_allocated() / 1e9,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
    }


def _checkpointing(model: Any) -> None:
    """Activation checkpointing (non-reentrant) under transformers' current name, as a user's script enables it."""
    kwargs = {"use_reentrant": False}
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.enable_input_require_grads()


def _step_loop(model: Any, spec: dict[str, Any], device: str) -> dict[str, Any]:
    """The user's loop: forward with ``labels`` (the model's own loss), backward, AdamW; the timed steps' seconds
    (``times``) and the last step's loss (``final_loss``: that the steps trained). With ``spec["profile"]`` (CUDA),
    one more step runs under the CUDA profiler, as ``bench run --profile`` profiles ours: ``profile_*`` fields
    (:func:`~poros_lightning.tools.bench.timeline.profile_step`; the backward runs inside the ``forward`` phase, as
    in our accumulating runs)."""
    rows = int(spec["batch_size"]) * int(spec["accumulate"])
    batches = bench_batches(spec["vocab"], rows, spec["seq_len"], spec["warmup"] + spec["steps"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    times = []

    def step(ids: torch.Tensor, mark: Callable[[], None] = lambda: None) -> torch.Tensor:
        mark()
        loss = torch.zeros((), device=ids.device)
        for chunk in ids.chunk(int(spec["accumulate"])):
            out = model(input_ids=chunk, labels=chunk, use_cache=False)
            part = out.loss / int(spec["accumulate"])
            part.backward()
            loss = loss + part.detach()
        mark()
        mark()  # no backward phase of its own: each micro-batch's backward ran above
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark()
        return loss

    _reset_peaks()
    loss = torch.zeros(())
    for i, ids in enumerate(batches):
        ids = ids.to(device)
        _sync()
        t = time.perf_counter()
        loss = step(ids)
        _sync()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t)
    result: dict[str, Any] = {"times": times, "final_loss": float(loss)}
    if spec.get("profile") and device == "cuda" and batches:
        from poros_lightning.tools.bench.timeline import profile_step

        peaks = _peaks()  # the timed steps'
        ids = batches[-1].to(device)
        result.update({f"profile_{k}": v for k, v in profile_step(lambda mark: step(ids, mark)).items()})
        result.update(peaks)
    return result


def _hf_offload(spec: dict[str, Any]) -> dict[str, Any]:
    """transformers + bitsandbytes NF4 under ``device_map="auto"`` and ``max_memory`` (GPU 0: ``vram_budget``, the
    rest in host memory, ``llm_int8_enable_fp32_cpu_offload``), PEFT LoRA on all linear layers, checkpointing."""
    import bitsandbytes  # noqa: F401 - its absence is the refusal, named
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from poros_lightning.memory.sizes import parse_bytes

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        llm_int8_enable_fp32_cpu_offload=True,
    )
    if torch.cuda.is_available():
        import psutil

        cpu = parse_bytes(spec["cpu_budget"]) if spec.get("cpu_budget") else int(psutil.virtual_memory().total * 0.8)
        placing: dict[str, Any] = {
            "device_map": "auto",
            "max_memory": {0: parse_bytes(spec["vram_budget"]), "cpu": cpu},
        }
        device = "cuda"
    else:  # the same path on the host alone (CPU CI): bitsandbytes' CPU kernels
        placing, device = {"device_map": {"": "cpu"}}, "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        spec["checkpoint"], quantization_config=quant, dtype=torch.bfloat16, **placing
    )
    placed = dict(getattr(model, "hf_device_map", {}) or {})
    if spec.get("prepare_kbit"):  # PEFT's QLoRA recipe in full: also casts the non-quantized weights to fp32
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        _checkpointing(model)
    r = int(spec["lora_r"])
    lora = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    result = _step_loop(model, spec, device)
    offloaded = sorted(k for k, v in placed.items() if str(v) in ("cpu", "disk"))
    return {
        **result,
        "offloaded_modules": len(offloaded) if device == "cuda" else None,
        "offloaded_sample": offloaded[:8] if device == "cuda" else None,
        "prepare_kbit": bool(spec.get("prepare_kbit")),
    }


def _unsloth(spec: dict[str, Any]) -> dict[str, Any]:
    """``FastLanguageModel.from_pretrained(load_in_4bit=True)``, ``get_peft_model`` on all linear layers with
    ``use_gradient_checkpointing="unsloth"``, then the plain loop."""
    if not torch.cuda.is_available():
        raise PeerRefusal("Unsloth trains on a GPU and CUDA is not available here")
    from unsloth import FastLanguageModel  # Note: [import order] - before transformers and peft

    model, _ = FastLanguageModel.from_pretrained(
        model_name=spec["checkpoint"], max_seq_length=int(spec["seq_len"]), load_in_4bit=True, dtype=torch.bfloat16
    )
    r = int(spec["lora_r"])
    model = FastLanguageModel.get_peft_model(
        model,
        r=r,
        lora_alpha=2 * r,
        lora_dropout=0,
        bias="none",
        target_modules=list(spec["targets"]),
        use_gradient_checkpointing="unsloth",
        random_state=int(spec.get("seed", 0)),
        max_seq_length=int(spec["seq_len"]),
    )
    return _step_loop(model, spec, "cuda")


def _soup(spec: dict[str, Any]) -> dict[str, Any]:
    """``soup train --config soup.yaml --yes`` in this process: its config, its loader (layer streaming from host
    memory, NF4), its trainer (TRL's ``SFTTrainer``); a callback times its optimizer steps (see
    :mod:`~poros_lightning.tools.bench.peer_soup`)."""
    from poros_lightning.tools.bench.peer_soup import train_soup

    return train_soup(spec, _reset_peaks, _sync, _peaks)


_RUNNERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "hf_offload": _hf_offload,
    "unsloth": _unsloth,
    "soup": _soup,
}


def _versions(peer: str) -> dict[str, Any]:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "missing"

    found = {"torch": torch.__version__, "transformers": version("transformers"), "peft": version("peft")}
    found["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    found["peer_version"] = " + ".join(f"{d} {version(d)}" for d in _VERSIONS[peer])
    return found


def _one_line(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}"[:300]


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the peer of ``spec`` here; its row (measured, refused or out of memory, never raised)."""
    row = peer_row(spec)
    peer = spec["peer"]
    try:
        missing = [m for m in PEER_PACKAGES[peer] if importlib.util.find_spec(m) is None]
        if missing:
            raise PeerRefusal(f"peer {peer} needs {' and '.join(missing)}, not installed here: {_HINT}")
        result = _RUNNERS[peer](spec)
    except PeerRefusal as err:
        row.update(refused=True, refusal=str(err))
    except torch.OutOfMemoryError as err:
        row.update(oom=True, refusal=_one_line(err), error=traceback.format_exc(limit=-8))
    except Exception as err:  # noqa: BLE001 - whatever the peer raises is its answer, recorded
        oom = "out of memory" in str(err).lower()
        row.update(refused=not oom, oom=oom, refusal=_one_line(err), error=traceback.format_exc(limit=-8))
    else:
        times = result.pop("times")
        if not times:
            row.update(refused=True, refusal="no timed step ran", **result)
        else:
            mean = sum(times) / len(times)
            tokens_per_s = row["effective_batch"] * int(spec["seq_len"]) / mean
            row.update({**_peaks(), **result, "s_per_step": mean, "s_per_step_min": min(times)})
            row["tokens_per_s"] = tokens_per_s
    try:
        import psutil

        row["host_rss_gb"] = psutil.Process().memory_info().rss / 1e9
    except ImportError:
        pass
    row.update(_versions(peer))
    return row


def main(argv: list[str] | None = None) -> int:
    """``run-one --spec SPEC.json --row ROW.json``: run one peer, write its row and print it as the last line."""
    p = argparse.ArgumentParser(prog="python -m poros_lightning.tools.bench.peer_runners")
    sub = p.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run-one", help="run one peer (a bench run's child process)")
    one.add_argument("--spec", required=True, help="JSON spec written by peers.run_peer")
    one.add_argument("--row", required=True, help="where to write the row (JSON)")
    args = p.parse_args(argv)
    row = run_one(json.loads(Path(args.spec).read_text()))
    Path(args.row).write_text(json.dumps(row))
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
