"""``poros-lightning bench run CONFIG`` and ``poros-lightning bench report JSONL... -o report.html``."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import yaml

from poros_lightning.errors import PorosConfigError

__all__ = ["main", "load_bench_config", "model_entries", "run_bench"]

_MODEL_KEYS = {
    "model",
    "model_config",
    "scale",
    "build",
    "seq_lens",
    "lora_r",
    "batch_size",
    "steps",
    "warmup",
    "compile_layers",
}
"""What an entry of ``models:`` may set for its model alone (the top level gives the defaults)."""
_KEYS = {
    "models",
    "model",
    "model_config",
    "scale",
    "seq_lens",
    "lora_r",
    "batch_size",
    "steps",
    "warmup",
    "runs",
    "out",
    "build",
    "compile_layers",
    "rounds",
    "profile",
    "memtrace",
    "peer_checkpoints",
    "peer_timeout_s",
}
_BUILDS = {"auto": None, "direct": False, "blockwise": True}


def load_bench_config(path: str | Path) -> dict[str, Any]:
    """Read and validate a bench YAML file: a path, or a shipped bench config's name (``qwen2.5-7b``)."""
    from poros_lightning.training.assets.configs import resolve_config

    path = resolve_config(path, "bench")
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise PorosConfigError(f"Cannot read bench config {str(path)!r}: {err}", "Pass a readable YAML file.") from err
    unknown = set(cfg) - _KEYS
    if unknown:
        raise PorosConfigError(
            f"Unknown keys in {path}: {', '.join(sorted(unknown))}.", f"Allowed keys: {', '.join(sorted(_KEYS))}."
        )
    if not cfg.get("runs"):
        raise PorosConfigError(f"{path} lists no runs.", "Add `runs: [{method: poros}, {method: resident_gc}]`.")
    for run in cfg["runs"]:
        if run.get("method") == "peer":  # another library's run (tools/bench/peers.py)
            from poros_lightning.tools.bench.peers import check_peer_run

            check_peer_run(run, path)
        for key in ("accumulate", "micro_batches"):
            value = run.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PorosConfigError(
                    f"`{key}` of run {run.get('name', run.get('method'))!r} in {path} must be a positive integer, "
                    f"got {value!r}.",
                    "accumulate: micro-batches per step, one after the other (sample-major); micro_batches: per "
                    "block (block-major, method poros only). The effective batch is batch_size x both.",
                )
        if run.get("optimizer", "adamw") not in ("adamw", "paged_adamw_8bit"):
            raise PorosConfigError(
                f"Unknown optimizer {run.get('optimizer')!r} of run {run.get('name', run.get('method'))!r} in {path}.",
                "optimizer: adamw (torch.optim.AdamW, the default) or paged_adamw_8bit (bitsandbytes, CUDA only).",
            )
        if run.get("precision", "32-true") not in ("32-true", "bf16-mixed"):
            raise PorosConfigError(
                f"Unknown precision {run.get('precision')!r} of run {run.get('name', run.get('method'))!r} in {path}.",
                "precision: 32-true (the default: no autocast) or bf16-mixed (each forward under bf16 autocast, as "
                "Trainer(precision='bf16-mixed')).",
            )
        chunk = run.get("loss_chunk_tokens")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise PorosConfigError(
                f"`loss_chunk_tokens` of run {run.get('name', run.get('method'))!r} in {path} must be a positive "
                f"integer, got {chunk!r}.",
                "loss_chunk_tokens: the LM head and the loss computed that many tokens at a time (leave it out for "
                "the whole batch's logits at once).",
            )
        if run.get("micro_batches", 1) > 1 and run.get("method") != "poros":
            raise PorosConfigError(
                f"Run {run.get('name', run.get('method'))!r} in {path} sets micro_batches with method "
                f"{run.get('method')!r}.",
                "Block-major micro-batches are an engine option (method: poros); give resident runs `accumulate`.",
            )
    models = cfg.get("models")
    if models is not None:
        if not isinstance(models, list) or not models or not all(isinstance(m, dict) for m in models):
            raise PorosConfigError(
                f"`models` in {path} must be a non-empty list of mappings.",
                "Write e.g. `models: [{model: Qwen/Qwen2.5-7B, scale: 7B}, {model: Qwen/Qwen2.5-32B, scale: 32B}]`.",
            )
        if {"model", "model_config"} & set(cfg):
            raise PorosConfigError(
                f"{path} has both `models` and a top-level `model`/`model_config`.",
                "Give each model as an entry of `models:`, or use `model:` alone.",
            )
        for entry in models:
            unknown = set(entry) - _MODEL_KEYS
            if unknown:
                raise PorosConfigError(
                    f"Unknown keys in an entry of `models` in {path}: {', '.join(sorted(unknown))}.",
                    f"An entry may set: {', '.join(sorted(_MODEL_KEYS))}.",
                )
            if not {"model", "model_config"} & set(entry):
                raise PorosConfigError(
                    f"An entry of `models` in {path} names no model: {entry}.",
                    "Give it `model: <hub id>` (bundled config facts) or `model_config: {...}`.",
                )
    for entry in model_entries(cfg):
        if entry.get("build", "auto") not in _BUILDS:
            raise PorosConfigError(
                f"Unknown build {entry['build']!r} in {path}.",
                "Use build: auto (blockwise when bf16 weights would not fit), direct or blockwise.",
            )
    return cfg


def run_name(run: dict[str, Any]) -> str:
    """A run's name in rows and for ``--runs``: its ``name``, else ``peer_<peer>`` for a peer run, else its method."""
    if "name" in run:
        return str(run["name"])
    return f"peer_{run.get('peer')}" if run.get("method") == "peer" else str(run["method"])


def model_entries(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per model of a bench config: its ``models:`` entry over the top-level defaults (or the config's
    single ``model``), restricted to the keys a model may set."""
    defaults = {k: v for k, v in cfg.items() if k in _MODEL_KEYS}
    return [{**defaults, **entry} for entry in cfg.get("models") or [{}]]


def _label(entry: dict[str, Any]) -> str:
    """How rows and ``--models`` name a model: its ``scale``, else its hub id, else its ``model_type``."""
    return str(entry.get("scale") or entry.get("model") or (entry.get("model_config") or {}).get("model_type"))


def select_models(cfg: dict[str, Any], names: list[str], path: str | Path = "the config") -> None:
    """Keep the models of ``cfg`` whose ``scale`` or ``model`` is one of ``names`` (case ignored), in place."""
    wanted = {n.lower() for n in names}
    entries = model_entries(cfg)
    names_of = [{_label(e).lower(), str(e.get("model", "")).lower()} for e in entries]
    missing = sorted(wanted - set().union(*names_of))
    if missing:
        raise PorosConfigError(
            f"No model {', '.join(missing)} in {path}.",
            f"Models there (scale or hub id): {', '.join(_label(e) for e in entries)}.",
        )
    if "models" in cfg:
        cfg["models"] = [m for m, names_ in zip(cfg["models"], names_of, strict=True) if names_ & wanted]


def _override(cfg: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` for every model (a command-line value beats the YAML's, top level and entries alike)."""
    cfg[key] = value
    for entry in cfg.get("models") or []:
        entry.pop(key, None)


def run_bench(cfg: dict[str, Any], out: str | Path | None = None) -> list[dict[str, Any]]:
    """Run every (model, seq_len, run) of a bench config; append rows to ``out`` (JSONL) and return them.

    Each (model, seq_len) builds its model once and runs ``runs`` on it in order, in this one process.
    """
    from poros_lightning.tools.bench.harness import measure_h2d

    h2d = measure_h2d()
    run_id = f"{time.strftime('%Y-%m-%dT%H:%M:%S')}-{os.getpid()}"  # rows of one process share it
    rows = []
    rounds = int(cfg.get("rounds", 1))
    if rounds < 1:
        raise PorosConfigError(f"rounds must be >= 1, got {rounds}.", "Use rounds: 1 (default) or more.")
    # Several rounds interleave the methods (A B A B ...): a drift of the machine hits all of them alike.
    runs = [{**run, "round": i} for i in range(rounds) for run in cfg["runs"]] if rounds > 1 else cfg["runs"]
    peers = {"root": cfg.get("peer_checkpoints"), "timeout_s": cfg.get("peer_timeout_s")}  # tools/bench/peers.py
    for entry in model_entries(cfg):
        _run_model(
            entry, runs, out, rows, h2d=h2d, run_id=run_id, profile=bool(cfg.get("profile")), peers=peers,
            memtrace=bool(cfg.get("memtrace")),
        )  # fmt: skip
    return rows


def _run_model(
    entry: dict[str, Any],
    runs: list[dict[str, Any]],
    out: str | Path | None,
    rows: list[dict[str, Any]],
    *,
    h2d: float | None,
    run_id: str,
    profile: bool,
    peers: dict[str, Any],
    memtrace: bool = False,
) -> None:
    """Every (seq_len, run) of one model entry; rows go to ``rows`` and ``out`` as each run ends.

    Per sequence length, the runs of the harness share one model build; the peer runs (``method: peer``) follow,
    each in a process of its own, once that model is freed (``peers``: their checkpoint root and timeout).
    """
    import torch

    from poros_lightning.tools.bench.harness import bench_methods, write_jsonl
    from poros_lightning.tools.parity.runner import versions

    if "model_config" in entry:
        config = dict(entry["model_config"])
    else:
        from poros_lightning.tools.check import load_config

        config, _ = load_config(entry["model"])

    label = f"{entry.get('model', config.get('model_type'))} (random init)"

    def record(row: dict[str, Any]) -> None:
        full = {
            "model": label,
            "scale": entry.get("scale"),
            "pinned_peak_h2d_gbps": h2d,
            "run_id": run_id,
            **row,
            **versions(),
        }
        shown = ("scale", "seq_len", "method", "vram_budget", "s_per_step", "step_s", "peak_vram_gb", "oom", "refused")
        clocks = full.get("gpu_clocks") or {}
        print({**{k: full.get(k) for k in shown}, "sm_mhz_mean": clocks.get("sm_mhz_mean")})
        rows.append(full)
        if out is not None:
            write_jsonl([full], out)  # as soon as the run ends: a later crash or kill loses nothing measured
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    ours = [run for run in runs if run.get("method") != "peer"]
    theirs = [run for run in runs if run.get("method") == "peer"]
    shape = {
        "batch_size": int(entry.get("batch_size", 1)),
        "lora_r": int(entry.get("lora_r", 16)),
        "steps": int(entry.get("steps", 10)),
        "warmup": int(entry.get("warmup", 3)),
        "blockwise": _BUILDS[entry.get("build", "auto")],
    }
    for seq_len in entry.get("seq_lens", [512]):
        if ours:
            bench_methods(
                config,
                ours,
                seq_len=int(seq_len),
                **shape,
                compile_layers=bool(entry.get("compile_layers", False)),
                profile=profile,
                memtrace=memtrace,
                on_row=record,
            )
        if theirs:
            import gc

            from poros_lightning.tools.bench.peers import run_peers

            gc.collect()  # our model of this length, gone before the peers' processes start
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            scale = entry.get("scale")
            run_peers(
                config, theirs, model=label, scale=scale, seq_len=int(seq_len), **shape, **peers, on_row=record,
                profile=profile,
            )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``poros-lightning bench``."""
    p = argparse.ArgumentParser(prog="poros-lightning bench", description="Benchmarks: run them, report them.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a bench YAML (see configs/bench/) and append JSONL rows")
    run.add_argument("config", help="bench YAML: a path, or a shipped config's name (e.g. qwen2.5-7b)")
    run.add_argument("--out", help="JSONL file to append to (overrides the YAML's `out`)")
    run.add_argument("--steps", type=int, help="timed steps (overrides the YAML)")
    run.add_argument("--runs", nargs="+", metavar="NAME", help="only the runs of these names (default: all)")
    run.add_argument("--seq-lens", type=int, nargs="+", help="sequence lengths (overrides the YAML)")
    run.add_argument("--models", nargs="+", metavar="NAME", help="only these models, by scale or hub id (default: all)")
    run.add_argument("--rounds", type=int, help="interleaved rounds of the runs (overrides the YAML)")
    run.add_argument(
        "--profile",
        action="store_true",
        help="profile two more steps per run (CUDA): where one's GPU time went, and where the other's host time went "
        "(CUDA API calls, Python functions); added to the row as profile_* fields",
    )
    run.add_argument(
        "--memtrace",
        action="store_true",
        help="run one more step per run under the CUDA allocator's history and add what was allocated at its "
        "peak, and where, to the row (memtrace_* fields)",
    )
    rep = sub.add_parser("report", help="render an HTML report (and print a Markdown table) from JSONL files")
    rep.add_argument("jsonl", nargs="+")
    rep.add_argument("-o", "--output", default="docs/benchmarks/report.html")
    rep.add_argument(
        "--where", action="append", default=[], metavar="KEY=VALUE", help="keep rows whose field KEY is VALUE"
    )
    rep.add_argument(
        "--profile",
        action="store_true",
        help="also print the per-phase profile, kernels and host time of rows run with `bench run --profile`",
    )
    rep.add_argument(
        "--memtrace", action="store_true", help="also print what was allocated at the peak of rows run with --memtrace"
    )
    rep.add_argument(
        "--clocks", action="store_true", help="also print each row's timed steps and the GPU's clocks over them"
    )
    rep.add_argument("--since", metavar="RUN_ID", help="keep rows whose run_id sorts at or after RUN_ID (a date)")
    rep.add_argument(
        "--estimates",
        action="store_true",
        help="also print every measured plan priced by this version's memory model beside its allocated peak",
    )
    rep.add_argument(
        "--ratio-to",
        metavar="METHOD",
        help="also print each method's mean s/step over its rounds and its ratio to METHOD's in the same run",
    )
    args = p.parse_args(argv)
    if args.command == "run":
        cfg = load_bench_config(args.config)
        if args.models:
            select_models(cfg, args.models, args.config)
        if args.steps:
            _override(cfg, "steps", args.steps)
        if args.seq_lens:
            _override(cfg, "seq_lens", args.seq_lens)
        if args.rounds is not None:
            cfg["rounds"] = args.rounds
        if args.profile:
            cfg["profile"] = True
        if args.memtrace:
            cfg["memtrace"] = True
        if args.runs:
            names = [run_name(r) for r in cfg["runs"]]
            missing = sorted(set(args.runs) - set(names))
            if missing:
                raise PorosConfigError(
                    f"No run named {', '.join(missing)} in {args.config}.", f"Runs there: {', '.join(names)}."
                )
            cfg["runs"] = [r for r, name in zip(cfg["runs"], names, strict=True) if name in args.runs]
        run_bench(cfg, args.out or cfg.get("out"))
        return 0
    from poros_lightning.tools.bench.report import (
        load_rows,
        markdown_table,
        profile_table,
        ratio_table,
        render_html,
        sweep_table,
    )

    rows = load_rows(args.jsonl)
    for cond in args.where:
        key, sep, value = cond.partition("=")
        if not sep:
            raise PorosConfigError(f"--where {cond!r} is not KEY=VALUE.", "Write e.g. --where initial_adapter=host.")
        rows = [r for r in rows if str(r.get(key)).lower() == value.lower()]
    if args.since:
        rows = [r for r in rows if str(r.get("run_id", "")) >= args.since]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(render_html(rows))
    print(markdown_table(rows))
    sweep = sweep_table(rows)
    if sweep:
        print()
        print(sweep)
    if args.ratio_to:
        print()
        print(ratio_table(rows, args.ratio_to))
    if args.profile:
        from poros_lightning.tools.bench.report import host_table, kernel_table

        print()
        print(profile_table(rows))
        print()
        print(kernel_table(rows))
        print()
        print(host_table(rows))
    if args.memtrace:
        from poros_lightning.tools.bench.report import memtrace_table

        print()
        print(memtrace_table(rows))
    if args.clocks:
        from poros_lightning.tools.bench.report import clocks_table

        print()
        print(clocks_table(rows))
    if args.estimates:
        from poros_lightning.tools.bench.estimates import estimates_table

        print()
        print(estimates_table(rows))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
