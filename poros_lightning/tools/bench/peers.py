"""Peers in the bench: what users pick instead of poros, each run as its users run it, in a process of its own.

A peer run of a bench YAML (``{method: peer, peer: hf_offload|unsloth|soup}``) trains the bench's model on the
bench's token batches through the peer's own loading and training path: the same random-init weights, written once
as a bf16 safetensors checkpoint (:func:`write_checkpoint`, reused while it exists), and the same batches
(:func:`bench_batches`, the draws of the harness). Each peer runs in a child process of its own
(``python -m poros_lightning.tools.bench.peer_runners run-one``), so what it loads, patches or leaks stays there.

Invariant: every peer run yields exactly one row. A peer that is not installed, refuses the model, crashes, hangs
past its timeout or runs out of memory is a row saying so (``refused`` or ``oom``, the reason in one line as
``refusal``, the last lines of its output as ``error``), and the sweep goes on to the next run.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poros_lightning.errors import PorosConfigError

__all__ = [
    "PEERS",
    "PEER_PACKAGES",
    "bench_batches",
    "check_peer_run",
    "default_checkpoint_root",
    "peer_row",
    "run_peer",
    "run_peers",
    "write_checkpoint",
]

PEERS = ("hf_offload", "unsloth", "soup")
"""``hf_offload``: transformers ``device_map="auto"`` with ``max_memory`` over a bitsandbytes NF4 model, PEFT LoRA;
``unsloth``: ``FastLanguageModel``; ``soup``: ``soup train`` with ``training.stream_layers``."""
PEER_PACKAGES = {
    "hf_offload": ("bitsandbytes",),
    "unsloth": ("unsloth", "unsloth_zoo"),
    "soup": ("soup_cli", "datasets"),
}
"""The modules each peer imports beyond the bench's own (a peer without them is a refused row)."""
_RUN_KEYS = {"method", "peer", "name", "accumulate", "vram_budget", "cpu_budget", "prepare_kbit", "timeout_s", "round"}
_MARK = "poros_checkpoint.json"  # written last: its presence marks a complete checkpoint
_TAIL_LINES = 25
DEFAULT_TIMEOUT_S = 1800.0


def default_checkpoint_root() -> Path:
    """Where peer checkpoints go unless the YAML's ``peer_checkpoints`` says otherwise (the system temp dir)."""
    return Path(tempfile.gettempdir()) / "poros-peer-ckpt"


def check_peer_run(run: dict[str, Any], path: str | Path = "the config") -> None:
    """Validate one ``method: peer`` run of a bench YAML (at load time, before anything is built)."""
    name = run.get("name", f"peer_{run.get('peer')}")
    if run.get("peer") not in PEERS:
        raise PorosConfigError(
            f"Run {name!r} in {path} names peer {run.get('peer')!r}.",
            f"A peer run takes `peer: <one of {', '.join(PEERS)}>`.",
        )
    unknown = set(run) - _RUN_KEYS
    if unknown:
        raise PorosConfigError(
            f"Run {name!r} in {path} sets {', '.join(sorted(unknown))}, which a peer run does not take.",
            f"A peer run may set: {', '.join(sorted(_RUN_KEYS))} (the peer picks everything else itself).",
        )
    if run["peer"] == "hf_offload" and run.get("vram_budget") is None:
        raise PorosConfigError(
            f"Run {name!r} in {path} (peer hf_offload) has no vram_budget.",
            "Give it `vram_budget: 16GB`: the max_memory of GPU 0 that device_map='auto' places the model under.",
        )
    timeout = run.get("timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
        raise PorosConfigError(
            f"Run {name!r} in {path} has timeout_s {timeout!r}.",
            "Give it a positive number of seconds, or leave it out for the config's `peer_timeout_s`.",
        )
    from poros_lightning.memory.sizes import parse_bytes

    for key in ("vram_budget", "cpu_budget"):
        if run.get(key) is not None:
            parse_bytes(run[key])


def bench_batches(vocab: int, rows: int, seq_len: int, count: int) -> list[Any]:
    """The harness's token batches (its ``batches_of``): ``count`` batches of ``rows`` x ``seq_len`` ids, seed 0."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (rows, seq_len), generator=gen) for _ in range(count)]


def _digest(config: dict[str, Any], seed: int, blockwise: bool) -> str:
    key = json.dumps({"config": config, "seed": seed, "blockwise": blockwise}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _blockwise(config: dict[str, Any], device: str, blockwise: bool | None) -> bool:
    """The build the bench picks (``parity.build``): blockwise when asked, or when bf16 would not fit the device."""
    if blockwise is not None:
        return blockwise
    if device != "cuda":
        return False
    import torch

    from poros_lightning.tools.parity.build import bf16_bytes

    free, _ = torch.cuda.mem_get_info()
    return bf16_bytes(config) > 0.8 * free


def _write_tokenizer(out: Path) -> None:
    """A two-token tokenizer: peers get token ids, but their loaders open a tokenizer beside the weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(out)


def write_checkpoint(
    config: dict[str, Any],
    root: str | Path,
    *,
    seed: int = 0,
    blockwise: bool | None = None,
    device: str | None = None,
) -> Path:
    """Write the bench's random-init model of ``config`` as a bf16 safetensors checkpoint under ``root``; reuse it.

    The weights are those the bench quantizes: the direct build (``torch.manual_seed(seed)`` then ``from_config``
    on ``device``, as :func:`~poros_lightning.tools.parity.build.build_peft_model`) or, blockwise, the loader's
    per-tensor draws (:func:`~poros_lightning.quant.loader.random_checkpoint`). A two-token tokenizer goes beside
    them. The directory is named by the config, seed and build; a complete one (its marker file written last) is
    returned as it is.
    """
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    blockwise = _blockwise(config, device, blockwise)
    out = Path(root).expanduser() / f"{config.get('model_type', 'model')}-{_digest(config, seed, blockwise)}"
    if (out / _MARK).is_file():
        return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if blockwise:
        from poros_lightning.quant.loader import random_checkpoint

        random_checkpoint(config, partial, seed=seed, device=device, progress=False)
    else:
        from poros_lightning.quant.hf_config import build_from_config, checkpoint_auto_class, hf_config

        hf = hf_config(config)
        hf._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        with torch.device(device):
            model = build_from_config(checkpoint_auto_class(config["model_type"]), hf, dtype=torch.bfloat16)
        model.save_pretrained(partial)
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    _write_tokenizer(partial)
    mark = {"config": config, "seed": seed, "build": "blockwise" if blockwise else "direct", "device": device}
    (partial / _MARK).write_text(json.dumps(mark, indent=2, sort_keys=True, default=str))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def peer_row(spec: dict[str, Any]) -> dict[str, Any]:
    """A peer's row before it runs: the bench's core fields, nothing measured yet."""
    from poros_lightning.memory.sizes import parse_bytes

    budget = spec.get("vram_budget")
    effective = int(spec["batch_size"]) * int(spec["accumulate"])
    return {
        "method": spec["name"],
        "base_method": "peer",
        "peer": spec["peer"],
        "model": spec.get("model"),
        "scale": spec.get("scale"),
        "seq_len": spec["seq_len"],
        "batch_size": spec["batch_size"],
        "accumulate": spec["accumulate"],
        "micro_batches": 1,
        "effective_batch": effective,
        "lora_r": spec["lora_r"],
        "quantization": "nf4-dq",
        "optimizer": "adamw",
        "steps": spec["steps"],
        "warmup": spec["warmup"],
        "vram_budget": parse_bytes(budget) / 1e9 if budget is not None else None,
        "planned_peak_gb": None,
        "refused": False,
        "oom": False,
        "s_per_step": None,
        "s_per_step_min": None,
        "tokens_per_s": None,
        "peak_vram_gb": None,
        "peak_reserved_gb": None,
        "peer_version": None,
        **({"round": spec["round"]} if "round" in spec else {}),
    }


def _tail(text: str, lines: int = _TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _child_env() -> dict[str, str]:
    """The parent's environment, offline, with this checkout first on the path (the child runs ``-m`` from its
    work directory)."""
    root = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "UNSLOTH_DISABLE_STATISTICS"):
        env.setdefault(var, "1")
    env["POROS_LIGHTNING_LIGHT"] = "1"  # no Lightning, transformers or peft before the peer (peer_runners' Note)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("WANDB_MODE", "disabled")
    return env


def run_peer(spec: dict[str, Any], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Run one peer in a child process (its work directory ``spec["workdir"]``) and return its row.

    The child writes its row (measured, refused or out of memory) to ``row.json``; a child that leaves none, or
    outlives ``timeout_s`` (it and every process it started are killed), is a refused row with its log's tail.
    Every row names the child's full output (``log``).
    """
    work = Path(spec["workdir"]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    spec_file, row_file, log_file = work / "spec.json", work / "row.json", work / "peer.log"
    spec_file.write_text(json.dumps(spec, indent=2))
    row_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "poros_lightning.tools.bench.peer_runners", "run-one", "--spec", str(spec_file)]
    cmd += ["--row", str(row_file)]
    print(f"peer {spec['name']} (seq {spec['seq_len']}): a process of its own, log {log_file}", flush=True)
    with log_file.open("w") as log:
        proc = subprocess.Popen(
            cmd, cwd=work, env=_child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        with contextlib.suppress(ProcessLookupError):  # its own session: workers it left behind go too
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    output = log_file.read_text(errors="replace")
    if row_file.is_file():
        row = json.loads(row_file.read_text())
        if code:
            row["exit_code"] = code  # measured, then failed on the way out (saving, cleanup): the row stands
        if row.get("refused") or row.get("oom"):  # what the peer printed last: its own words for the failure
            row["log_tail"] = _tail(output)
        return {**row, "log": str(log_file)}
    if code is None:
        reason = f"timed out after {timeout_s:g} s"
    elif code < 0:
        try:
            reason = f"killed by signal {signal.Signals(-code).name} (host out of memory?)"
        except ValueError:
            reason = f"killed by signal {-code}"
    else:
        reason = f"exited with code {code} before writing its row"
    return {**peer_row(spec), "refused": True, "refusal": reason, "error": _tail(output), "log": str(log_file)}


def _workdir_name(name: str, label: str, seq_len: int, run: dict[str, Any]) -> str:
    """A run's work directory, one per (run, model, seq_len, round): no run's log overwrites another's."""
    parts = [name, label, f"s{seq_len}"] + ([f"r{run['round']}"] if "round" in run else [])
    return "-".join("".join(c if c.isalnum() or c in "._" else "_" for c in part) for part in parts)


def run_peers(
    config: dict[str, Any],
    runs: list[dict[str, Any]],
    *,
    model: str,
    scale: str | None,
    seq_len: int,
    batch_size: int,
    lora_r: int,
    steps: int,
    warmup: int,
    blockwise: bool | None = None,
    root: str | Path | None = None,
    timeout_s: float | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    profile: bool = False,
) -> list[dict[str, Any]]:
    """Every peer run of ``runs`` on the bench's model of ``config``, one child process each, in order.

    The checkpoint is written first under ``root`` (:func:`default_checkpoint_root` when None), or reused; a
    checkpoint that cannot be written makes every run a refused row. Each child gets ``timeout_s`` (a run's own
    ``timeout_s`` first; :data:`DEFAULT_TIMEOUT_S` when None). ``on_row`` gets each row as its run ends. ``profile``:
    each peer profiles one more step, as ``bench run --profile`` does ours (Soup's from a trainer callback).
    """
    from poros_lightning.arch import get_arch
    from poros_lightning.quant.hf_config import text_config

    # Absolute: each child runs in a work directory of its own and reads the checkpoint and its spec from there.
    root = (Path(root).expanduser() if root is not None else default_checkpoint_root()).resolve()
    text = text_config(config)
    try:
        targets = list(get_arch(config["model_type"]).lora_targets)
    except Exception:  # noqa: BLE001 - an unlisted family: the peers' own "all linear" spelling
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    failure: tuple[str, str] | None = None
    checkpoint = None
    try:  # not for peers that will only say what they miss (peer_runners refuses them first)
        if any(all(importlib.util.find_spec(m) for m in PEER_PACKAGES[run["peer"]]) for run in runs):
            checkpoint = write_checkpoint(config, root, blockwise=blockwise)
    except Exception as err:  # noqa: BLE001 - recorded as every peer's refusal, the bench goes on
        import traceback

        failure = (f"cannot write the checkpoint: {type(err).__name__}: {err}", _tail(traceback.format_exc()))
    rows = []
    for run in runs:
        name = run.get("name", f"peer_{run['peer']}")
        spec = {
            "peer": run["peer"],
            "name": name,
            "model": model,
            "scale": scale,
            "checkpoint": str(checkpoint) if checkpoint else None,
            "workdir": str(root / "runs" / _workdir_name(name, scale or config["model_type"], seq_len, run)),
            "model_type": config["model_type"],
            "vocab": int(text["vocab_size"]),
            "targets": targets,
            "seq_len": seq_len,
            "batch_size": batch_size,
            "accumulate": int(run.get("accumulate", 1)),
            "lora_r": lora_r,
            "steps": steps,
            "warmup": warmup,
            "seed": 0,
            "profile": profile,
            **{k: run[k] for k in ("vram_budget", "cpu_budget", "prepare_kbit", "round") if k in run},
        }
        if failure is not None:
            row = {**peer_row(spec), "refused": True, "refusal": failure[0], "error": failure[1]}
        else:
            try:
                row = run_peer(spec, timeout_s=float(run.get("timeout_s") or timeout_s or DEFAULT_TIMEOUT_S))
            except Exception as err:  # noqa: BLE001 - its work directory, its process: still a row, the bench goes on
                import traceback

                reason = f"cannot start its process: {type(err).__name__}: {err}"
                row = {**peer_row(spec), "refused": True, "refusal": reason, "error": _tail(traceback.format_exc())}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
