"""Tables and an HTML report generated from benchmark JSONL files (no numbers live anywhere else)."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from poros_lightning.tools.bench.sweep import sweep_html, sweep_table

__all__ = [
    "host_table",
    "load_rows",
    "markdown_table",
    "memtrace_table",
    "clocks_table",
    "peers_html",
    "kernel_table",
    "profile_table",
    "ratio_table",
    "render_html",
    "sweep_table",
]

_COLUMNS = (
    ("model", "model"),
    ("seq_len", "seq"),
    ("lora_r", "LoRA r"),
    ("method", "method"),
    ("s_per_step", "s/step"),
    ("tokens_per_s", "tokens/s"),
    ("peak_vram_gb", "peak VRAM GB"),
    ("host_rss_gb", "host RSS GB"),
    ("h2d_gbps", "H2D GB/s (step avg)"),
    ("h2d_copy_gbps", "H2D GB/s (while copying)"),
)


def load_rows(paths: list[str | Path]) -> list[dict[str, Any]]:
    """Every benchmark row (lines with a ``method``) of the given JSONL files, with its source file."""
    rows = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if "method" in row:
                    rows.append({**row, "source": str(path)})
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return str(value)


def _cells(row: dict[str, Any]) -> list[str]:
    cells = [_fmt(row.get(key)) for key, _ in _COLUMNS]
    if row.get("oom"):
        cells[4] = f"OOM under {row['memory_cap_gb']} GB cap" if row.get("memory_cap_gb") else "OOM"
    elif row.get("refused"):
        needs = row.get("min_budget_gb")
        cells[4] = f"refused (needs {_fmt(needs)} GB)" if needs is not None else "refused"
    return cells


_PEER_COLUMNS = ("method", "tokens/s", "peak VRAM GB", "peak reserved GB", "s/step", "peer version")


def _peer_cells(row: dict[str, Any]) -> list[str]:
    cells = _cells(row)
    name = row["method"] + (" (peer)" if row.get("base_method") == "peer" else "")
    return [name, cells[5], cells[6], _fmt(row.get("peak_reserved_gb")), cells[4], _fmt(row.get("peer_version"))]


def _where(row: dict[str, Any]) -> str:
    return f"{row['method']} ({row.get('scale') or row.get('model')}, seq {row.get('seq_len')})"


def peers_html(rows: list[dict[str, Any]]) -> str:
    """The report's peers section (empty without peer rows): per (model, seq_len) with a peer row, our runs and the
    peers' (``base_method: peer``) side by side, then each peer that did not run with its reason."""
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row.get("scale") or row.get("model"), row.get("seq_len")), []).append(row)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in _PEER_COLUMNS)
    parts = []
    for (label, seq_len), group in groups.items():
        if any(r.get("base_method") == "peer" for r in group):
            body = "".join(
                "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _peer_cells(r)) + "</tr>" for r in group
            )
            title = html.escape(f"{label}, seq {seq_len}")
            parts.append(f"<h3>{title}</h3><table border='1' cellpadding='4'><tr>{head}</tr>{body}</table>")
    if not parts:
        return ""
    failed = [r for r in rows if r.get("base_method") == "peer" and (r.get("refused") or r.get("oom"))]
    if failed:
        items = "".join(
            f"<li>{html.escape(_where(r))}: {html.escape(str(r.get('refusal') or 'out of memory'))}</li>"
            for r in failed
        )
        parts.append(f"<h3>Peers that did not run</h3><ul class='peer-refusals'>{items}</ul>")
    intro = (
        "<h2>Peers</h2><p>What users pick instead, each run as its users run it, in a process of its own, on the same "
        "model, token batches and effective batch as our runs beside it (<code>configs/bench/peers.yaml</code>).</p>"
    )
    return intro + "\n".join(parts)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of ``rows`` (the README and docs embed its output)."""
    lines = ["| " + " | ".join(h for _, h in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


_PROFILE = (
    ("s", "s"),
    ("busy_s", "compute busy s"),
    ("idle_copying_s", "waits on copies s"),
    ("idle_host_s", "waits on host s"),
    ("compute_copy_s", "copies on compute stream s"),
    ("side_h2d_gb", "side H2D GB"),
    ("d2h_gb", "D2H GB"),
)


def profile_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the profiled step of every row that has one (``bench run --profile``), by phase."""
    lines = [
        "| method | phase | " + " | ".join(h for _, h in _PROFILE) + " |",
        "|---|---|" + "---|" * len(_PROFILE),
    ]
    for row in rows:
        for phase in ("forward", "backward", "update"):
            if f"profile_{phase}_s" in row:
                cells = [_fmt(row.get(f"profile_{phase}_{key}")) for key, _ in _PROFILE]
                lines.append(f"| {row['method']} | {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_table(rows: list[dict[str, Any]], top: int = 5) -> str:
    """A Markdown table of the profiled step of every row that has one, by kernel family (seconds of GPU time), and
    its ``top`` kernels of most time: what a faster run spends less on."""
    lines = ["| scale | seq | method | family or kernel | GPU s | kernels |", "|---|---|---|---|---|---|"]
    for row in rows:
        groups = row.get("profile_kernel_groups")
        if not groups:
            continue
        head = [str(row.get("scale")), str(row.get("seq_len")), str(row.get("method"))]
        entries = [(g, s, "") for g, s in groups.items()]
        entries += [
            (f"`{k['name'].replace('|', '/')}`", k["s"], str(k["count"])) for k in row["profile_top_kernels"][:top]
        ]
        for i, (name, seconds, count) in enumerate(entries):
            first = head if i == 0 else [""] * len(head)
            lines.append("| " + " | ".join([*first, name, _fmt(float(seconds)), count]) + " |")
    return "\n".join(lines)


def host_table(rows: list[dict[str, Any]], top: int = 8) -> str:
    """A Markdown table of where the host's time went in the profiled step of every row that has one: its ``top``
    CUDA API calls (``runtime``), Python functions by self time (``self``) and by time inside them (``cumulative``).
    Rows profiled alike compare; the Python profiler's own overhead is in every figure."""
    lines = ["| scale | seq | method | list | call or function | host s | calls |", "|---|---|---|---|---|---|---|"]
    lists = (("runtime", "profile_runtime_calls", "count"), ("self", "profile_host_self", "calls"),
             ("cumulative", "profile_host_cumulative", "calls"))  # fmt: skip
    for row in rows:
        entries = [(label, e) for label, key, _ in lists for e in (row.get(key) or [])[:top]]
        counts = {label: count for label, _, count in lists}
        head = [str(row.get("scale")), str(row.get("seq_len")), str(row.get("method"))]
        for i, (label, e) in enumerate(entries):
            first = head if i == 0 else [""] * len(head)
            name = f"`{str(e['name']).replace('|', '/')}`"
            lines.append("| " + " | ".join([*first, label, name, _fmt(float(e["s"])), str(e[counts[label]])]) + " |")
    return "\n".join(lines)


def memtrace_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of what each row run with ``bench run --memtrace`` had allocated at its step's peak, by where
    it was allocated, beside the row's estimate (``final_planned_peak_gb``, else ``planned_peak_gb``)."""
    lines = [
        "| scale | seq | method | peak GB (asked) | allocator peak GB | phase | planned GB | where | GB | tensors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "memtrace_top" not in row:
            continue
        planned = row.get("final_planned_peak_gb", row.get("planned_peak_gb"))
        head = [str(row.get("scale")), str(row.get("seq_len")), str(row.get("method"))]
        head += [_fmt(row.get("memtrace_peak_gb")), _fmt(row.get("memtrace_max_allocated_gb"))]
        head += [_fmt(row.get("memtrace_phase")), _fmt(planned)]
        for i, group in enumerate(row["memtrace_top"]):
            first = head if i == 0 else [""] * len(head)
            where = str(group["where"]).replace("|", "/")
            lines.append("| " + " | ".join([*first, f"`{where}`", _fmt(group["gb"]), str(group["count"])]) + " |")
    streams = [row for row in rows if row.get("memtrace_by_stream")]
    if streams:  # Note: [reserved by stream] (tools/bench/memtrace.py)
        lines += ["", "| scale | seq | method | reserved peak GB | stream | reserved GB | allocated GB | free GB |"]
        lines.append("|---|---|---|---|---|---|---|---|")
        for row in streams:
            head = [str(row.get("scale")), str(row.get("seq_len")), str(row.get("method"))]
            head.append(_fmt(row.get("memtrace_reserved_peak_gb")))
            for i, s in enumerate(row["memtrace_by_stream"]):
                cells = [*(head if i == 0 else [""] * len(head)), s["stream"]]
                cells += [_fmt(s["reserved_gb"]), _fmt(s["allocated_gb"]), _fmt(s["free_gb"])]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def clocks_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of each row's timed steps (``step_s``) beside the GPU's clocks over them (``gpu_clocks``,
    tools/bench/gpu_clocks.py): whether a slow row ran on a card whose clocks were held down, and why."""
    lines = [
        "| run | scale | seq | method | round | s/step | steps (s) | SM MHz min / mean / max | power W max | temp C max"
        " | clock reasons (share of samples) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if not row.get("step_s"):
            continue
        clocks = row.get("gpu_clocks") or {}
        mhz = " / ".join(_fmt(clocks.get(k)) for k in ("sm_mhz_min", "sm_mhz_mean", "sm_mhz_max")) if clocks else "—"
        reasons = ", ".join(f"{name} {share:.2f}" for name, share in (clocks.get("reasons") or {}).items())
        cells = [str(row.get("run_id")), str(row.get("scale")), str(row.get("seq_len")), str(row.get("method"))]
        cells += [_fmt(row.get("round")), _fmt(row.get("s_per_step")), " ".join(f"{t:.3f}" for t in row["step_s"])]
        cells += [mhz, _fmt(clocks.get("power_w_max")), _fmt(clocks.get("temp_c_max")), reasons or "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(rows: list[dict[str, Any]], baseline: str) -> str:
    """Mean s/step of each method over its rounds, and its ratio to ``baseline``'s mean in the same run.

    Rows are grouped by ``run_id``, ``model`` and ``seq_len`` (one process, one model build): ratios are only
    taken within a group, and with interleaved rounds (A B A B ...) a drift of the machine weighs on every
    method. Rows without a ``run_id`` (older files) and groups without a ``baseline`` row are left out.
    """
    groups: dict[tuple[Any, Any, Any, Any], dict[str, list[dict[str, Any]]]] = {}
    for row in rows:
        if row.get("s_per_step") is None or row.get("run_id") is None:
            continue
        # Steps of different effective batches are not compared: a ratio holds within one effective batch.
        key = (
            row["run_id"],
            row.get("model"),
            row.get("seq_len"),
            row.get("effective_batch", row.get("batch_size", 1)),
        )
        groups.setdefault(key, {}).setdefault(row["method"], []).append(row)
    header = (
        "model",
        "seq",
        "method",
        "rounds",
        "mean s/step",
        "min..max s/step",
        "tokens/s",
        "peak VRAM GB",
        f"x {baseline}",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for methods in groups.values():
        if baseline not in methods:
            continue
        base = sum(r["s_per_step"] for r in methods[baseline]) / len(methods[baseline])
        for method, runs in methods.items():
            times = [r["s_per_step"] for r in runs]
            mean = sum(times) / len(times)
            cells = (
                runs[0].get("model"),
                runs[0].get("seq_len"),
                method,
                len(runs),
                mean,
                f"{_fmt(min(times))}..{_fmt(max(times))}",
                _rows_per_step(runs[0]) * runs[0]["seq_len"] / mean if runs[0].get("seq_len") else None,
                max(r.get("peak_vram_gb") or 0.0 for r in runs),
                mean / base,
            )
            lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    return "\n".join(lines)


def _rows_per_step(row: dict[str, Any]) -> int:
    """Rows one optimizer step trains on (rows before ``effective_batch`` was recorded: ``batch_size``)."""
    return int(row.get("effective_batch", row.get("batch_size", 1)))


def _plot(rows: list[dict[str, Any]], key: str, label: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in rows if r.get(key) is not None]
    if not rows:
        return None
    names = [f"{r.get('scale', r.get('model', ''))} s{r.get('seq_len')}\n{r['method']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 3.5))
    ax.bar(range(len(rows)), [r[key] for r in rows], color="#3b7dd8")
    ax.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(label)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def render_html(rows: list[dict[str, Any]], title: str = "poros-lightning benchmarks") -> str:
    """A self-contained HTML page: plots (matplotlib, when installed), the peers side by side (when rows have
    ``base_method: peer``), the budget sweep (inline SVG, when rows have a ``vram_budget``) and the full table."""
    parts = [
        f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    parts.append("<p>Generated by <code>poros-lightning bench report</code> from the JSONL files listed below.</p>")
    for key, label in (("peak_vram_gb", "peak VRAM (GB)"), ("s_per_step", "seconds per step")):
        img = _plot(rows, key, label)
        if img:
            parts.append(f"<h2>{label}</h2><img alt='{label}' src='data:image/png;base64,{img}'>")
    for section in (peers_html(rows), sweep_html(rows)):
        if section:
            parts.append(section)
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in _COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _cells(r)) + "</tr>" for r in rows)
    parts.append(f"<h2>All runs</h2><table border='1' cellpadding='4'><tr>{head}</tr>{body}</table>")
    sources = sorted({r["source"] for r in rows})
    parts.append("<h2>Sources</h2><ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in sources) + "</ul>")
    return "\n".join(parts)
