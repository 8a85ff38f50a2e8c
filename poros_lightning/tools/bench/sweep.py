"""The budget sweep in the report: s/step against ``vram_budget`` for each (model, seq_len), as inline SVG.

Rows come from ``bench run`` (``configs/bench/planner-sweep.yaml``): runs with a ``vram_budget`` give the points,
a ``resident_gc`` run of the same model and sequence length gives the reference line, and budgets the planner
refused (``refused``) or that ran out of device memory (``oom``) are marked apart, on the axis, since they have no
step time. The SVG is written by hand so the report needs nothing beyond the standard library.
"""

from __future__ import annotations

import html
import math
from typing import Any

__all__ = ["budget_gb", "card_name", "sweep_groups", "sweep_html", "sweep_table"]

_W, _H = 560, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 60, 20, 34, 46
_HOST_OPTIONS = (
    ("embeddings_on_host", "embeddings"),
    ("optimizer_on_host", "optimizer"),
    ("head_on_host", "head"),
    ("inputs_on_host", "inputs"),
)


def budget_gb(row: dict[str, Any]) -> float | None:
    """A row's ``vram_budget`` in GB: a number (rows since the sweep fields) or a size string (older rows)."""
    value = row.get("vram_budget")
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    from poros_lightning.memory.planner import parse_bytes

    return parse_bytes(value) / 1e9


def card_name(row: dict[str, Any]) -> str | None:
    """The GPU a row ran on, short (``NVIDIA H100 80GB HBM3`` -> ``H100``); None where the row does not say."""
    words = str(row.get("gpu") or "").removeprefix("NVIDIA ").split()
    return words[0] if words else None


def _label(row: dict[str, Any]) -> str:
    """The group a row belongs to: its model, its effective batch and the card it ran on (rows of two cards, or of
    two effective batches, are never averaged or compared)."""
    name, card = str(row.get("scale") or row.get("model") or ""), card_name(row)
    batch = row.get("effective_batch") or 1
    name = f"{name} x{batch}" if batch > 1 else name
    return f"{name} on {card}" if card else name


def _is_reference(row: dict[str, Any]) -> bool:
    return row.get("base_method", row.get("method")) == "resident_gc" and budget_gb(row) is None


def sweep_groups(rows: list[dict[str, Any]]) -> dict[tuple[str, Any], list[dict[str, Any]]]:
    """Rows by (model, seq_len), for the groups with at least one ``vram_budget`` row: their budget rows and
    their ``resident_gc`` rows without a budget (the reference). Peer rows are not plans and stay out."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("base_method") == "peer":  # a peer's budget is its own setting, not a plan (report.peers_html)
            continue
        if budget_gb(row) is not None or _is_reference(row):
            groups.setdefault((_label(row), row.get("seq_len")), []).append(row)
    return {key: group for key, group in groups.items() if any(budget_gb(r) is not None for r in group)}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _plan_summary(row: dict[str, Any]) -> str:
    host = [name for key, name in _HOST_OPTIONS if row.get(key)]
    parts = [f"host: {', '.join(host)}"] if host else []
    if row.get("head_on_host") and row.get("head_copies") == 1:
        parts.append("1 head copy")
    if row.get("head_on_host") and row.get("head_prefetch") is False:
        parts.append("head copied when it runs")
    if row.get("resident_blocks"):
        parts.append(f"{row['resident_blocks']} resident blocks")
    if row.get("keep_activations"):
        parts.append(f"{row['keep_activations']} layers keep activations")
    return "; ".join(parts) or "streamed"


def _points(group: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float | None]:
    """One point per budget (means over repeated runs) and the reference's mean s/step (None without one)."""
    by_budget: dict[float, list[dict[str, Any]]] = {}
    for row in group:
        budget = budget_gb(row)
        if budget is not None:
            by_budget.setdefault(budget, []).append(row)
    points = []
    for budget, runs in sorted(by_budget.items()):
        times = [r["s_per_step"] for r in runs if r.get("s_per_step") is not None]

        def mean_of(key: str, runs: list[dict[str, Any]] = runs) -> float | None:
            return _mean([r[key] for r in runs if r.get(key) is not None])

        points.append(
            {
                "budget": budget,
                "s_per_step": _mean(times),
                "refused": any(r.get("refused") for r in runs),
                "oom": any(r.get("oom") for r in runs),
                "min_budget_gb": mean_of("min_budget_gb"),
                "planned_peak_gb": mean_of("planned_peak_gb"),
                "peak_vram_gb": mean_of("peak_vram_gb"),
                "peak_reserved_gb": mean_of("peak_reserved_gb"),
                "estimate_ratio": min((x for x in map(estimate_ratio, runs) if x is not None), default=None),
                "plan": _plan_summary(runs[0]),
                "runs": len(runs),
            }
        )
    reference = _mean([r["s_per_step"] for r in group if _is_reference(r) and r.get("s_per_step") is not None])
    return points, reference


def estimate_ratio(row: dict[str, Any]) -> float | None:
    """The planner's estimate over the measured allocated peak, for the plans a row measured; the smallest ratio.

    A tuned row prices each tuned step's own plan (``planned_gb`` beside that step's ``peak_allocated_gb``), and
    the timed steps' plan (``final_planned_peak_gb`` against the row's peak) when no tuned step ran a larger plan
    that could have set that peak. Older rows, and rows the tuner left alone, compare ``planned_peak_gb``."""
    measured = row.get("peak_vram_gb")
    tuned = [t for t in row.get("tuned") or [] if t.get("planned_gb") and t.get("peak_allocated_gb")]
    if not tuned:
        planned = row.get("planned_peak_gb")
        return planned / measured if planned and measured else None
    ratios = [t["planned_gb"] / t["peak_allocated_gb"] for t in tuned]
    final = row.get("final_planned_peak_gb")
    if final and measured and final >= max(t["planned_gb"] for t in tuned):
        ratios.append(final / measured)
    return min(ratios)


def _fmt(value: float | None, unit: str = "") -> str:
    return "—" if value is None else f"{value:.3f}{unit}" if value < 10 else f"{value:.1f}{unit}"


def _ticks(top: float) -> list[float]:
    """Round values for an axis from 0 to ``top`` (steps of 1, 2 or 5 times a power of ten), 0 excluded."""
    raw = top / 4
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [step * i for i in range(1, int(top / step) + 1)]


def _svg(title: str, points: list[dict[str, Any]], reference: float | None) -> str:
    """One plot: measured points joined by a line, refused (x) and out-of-memory (triangle) budgets on the
    axis, the reference as a dashed line, the planner's smallest budget as a dotted one."""
    smallest = _mean([p["min_budget_gb"] for p in points if p["min_budget_gb"] is not None])
    xs = [p["budget"] for p in points] + ([smallest] if smallest is not None else [])
    ys = [p["s_per_step"] for p in points if p["s_per_step"] is not None] + ([reference] if reference else [])
    x_max = max(xs) * 1.08
    y_max = max(ys) * 1.15 if ys else 1.0
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    y0 = _TOP + plot_h

    def x(v: float) -> float:
        return _LEFT + plot_w * v / x_max

    def y(v: float) -> float:
        return y0 - plot_h * v / y_max

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="budget-sweep" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" font-family="sans-serif" font-size="11">',
        f'<text x="{_W / 2:.0f}" y="16" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
        f'<line class="axis" x1="{_LEFT}" y1="{y0}" x2="{_W - _RIGHT}" y2="{y0}" stroke="#333"/>',
        f'<line class="axis" x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{y0}" stroke="#333"/>',
        f'<text x="{_LEFT + plot_w / 2:.0f}" y="{_H - 8}" text-anchor="middle">vram_budget (GB)</text>',
        f'<text transform="translate(14 {_TOP + plot_h / 2:.0f}) rotate(-90)" text-anchor="middle">s / step</text>',
    ]
    for p in points:
        out.append(
            f'<text x="{x(p["budget"]):.1f}" y="{y0 + 14}" text-anchor="middle">{p["budget"]:g}</text>'
            f'<line x1="{x(p["budget"]):.1f}" y1="{y0}" x2="{x(p["budget"]):.1f}" y2="{y0 + 4}" stroke="#333"/>'
        )
    for v in _ticks(y_max):
        out.append(
            f'<text x="{_LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{_fmt(v)}</text>'
            f'<line x1="{_LEFT}" y1="{y(v):.1f}" x2="{_W - _RIGHT}" y2="{y(v):.1f}" stroke="#eee"/>'
        )
    if reference is not None:
        out.append(
            f'<line class="reference resident_gc" x1="{_LEFT}" y1="{y(reference):.1f}" x2="{_W - _RIGHT}" '
            f'y2="{y(reference):.1f}" stroke="#888" stroke-dasharray="6 4"><title>resident_gc: '
            f"{_fmt(reference)} s/step</title></line>"
            f'<text x="{_W - _RIGHT - 4}" y="{y(reference) - 5:.1f}" text-anchor="end" fill="#555">'
            f"resident_gc {_fmt(reference)} s</text>"
        )
    if smallest is not None:
        out.append(
            f'<line class="minimum-budget" x1="{x(smallest):.1f}" y1="{_TOP}" x2="{x(smallest):.1f}" y2="{y0}" '
            f'stroke="#c60" stroke-dasharray="2 3"><title>the planner\'s smallest budget: {smallest:.2f} GB'
            "</title></line>"
        )
    measured = [p for p in points if p["s_per_step"] is not None]
    if len(measured) > 1:
        line = " ".join(f"{x(p['budget']):.1f},{y(p['s_per_step']):.1f}" for p in measured)
        out.append(f'<polyline class="measured" points="{line}" fill="none" stroke="#3b7dd8" stroke-width="1.5"/>')
    for p in points:
        cx = x(p["budget"])
        if p["s_per_step"] is not None:
            tip = (
                f"{p['budget']:g} GB: {_fmt(p['s_per_step'])} s/step"
                + (f" x{p['s_per_step'] / reference:.3f} resident_gc" if reference else "")
                + f"; peak {_fmt(p['peak_vram_gb'])} GB allocated, {_fmt(p['peak_reserved_gb'])} GB reserved; "
                f"plan {_fmt(p['planned_peak_gb'])} GB ({p['plan']})"
            )
            out.append(
                f'<circle class="point measured" cx="{cx:.1f}" cy="{y(p["s_per_step"]):.1f}" r="4" '
                f'fill="#3b7dd8"><title>{html.escape(tip)}</title></circle>'
            )
        if p["refused"]:
            tip = f"{p['budget']:g} GB: refused by the planner (smallest budget {_fmt(p['min_budget_gb'])} GB)"
            out.append(
                f'<path class="point refused" d="M{cx - 5:.1f},{y0 - 5} l10,-10 m-10,0 l10,10" stroke="#c60" '
                f'stroke-width="2"><title>{html.escape(tip)}</title></path>'
            )
        if p["oom"]:
            tip = f"{p['budget']:g} GB: out of device memory (plan {_fmt(p['planned_peak_gb'])} GB, {p['plan']})"
            out.append(
                f'<path class="point oom" d="M{cx - 6:.1f},{y0 - 2} l6,-11 l6,11 z" fill="#d33">'
                f"<title>{html.escape(tip)}</title></path>"
            )
    legend = (
        ("#3b7dd8", "● measured"),
        ("#888", "- - resident_gc"),
        ("#c60", "× refused"),
        ("#d33", "▲ out of memory"),
        ("#c60", "┊ smallest budget"),
    )
    at = _LEFT + 4
    for color, text in legend:
        out.append(f'<text x="{at:.0f}" y="{_TOP - 6}" fill="{color}">{html.escape(text)}</text>')
        at += 6.2 * len(text) + 14  # about 6 px a character at this size
    out.append("</svg>")
    return "".join(out)


def _table_rows(points: list[dict[str, Any]], reference: float | None) -> list[list[str]]:
    """One row of cells per budget. ``planned / allocated``: the plan's estimate over the measured allocated peak
    (:func:`estimate_ratio`, the smallest over the plans the runs measured; at least 1.0: the plan never
    under-predicts); ``x smaller budget``: s/step over that of the next smaller budget
    that ran (at most 1.03: a bigger budget is never slower)."""
    cells = []
    smaller: float | None = None
    for p in points:
        if p["refused"]:
            status = f"refused (needs {_fmt(p['min_budget_gb'])} GB)"
        elif p["oom"] and p["s_per_step"] is None:
            status = "out of memory"
        else:
            status = _fmt(p["s_per_step"])
        ratio = p["s_per_step"] / reference if reference and p["s_per_step"] is not None else None
        plan = "—" if p["refused"] else p["plan"]
        estimate = p["estimate_ratio"]
        monotonic = p["s_per_step"] / smaller if smaller and p["s_per_step"] is not None else None
        smaller = p["s_per_step"] if p["s_per_step"] is not None else smaller
        cells.append(
            [
                f"{p['budget']:g}",
                plan,
                _fmt(p["planned_peak_gb"]),
                _fmt(p["peak_vram_gb"]),
                _fmt(p["peak_reserved_gb"]),
                _fmt(estimate),
                status,
                _fmt(ratio),
                _fmt(monotonic),
            ]
        )
    return cells


_HEADER = (
    "budget GB",
    "plan",
    "planned GB",
    "peak allocated GB",
    "peak reserved GB",
    "planned / allocated",
    "s/step",
    "x resident_gc",
    "x smaller budget",
)


def sweep_html(rows: list[dict[str, Any]]) -> str:
    """The report's budget-sweep section (empty without budget rows): a plot and a table per (model, seq_len)."""
    groups = sweep_groups(rows)
    if not groups:
        return ""
    parts = [
        "<h2>s/step against the VRAM budget</h2>",
        "<p>Each point is the plan of <code>PorosStrategy(vram_budget=...)</code>, run capped at its budget; the "
        "dashed line is <code>resident_gc</code> in the same process; x marks a budget the planner refused, a "
        "triangle one that ran out of device memory. Hover for the plan and peaks.</p>",
    ]
    for (label, seq_len), group in groups.items():
        points, reference = _points(group)
        title = f"{label}, seq {seq_len}"
        head = "".join(f"<th>{html.escape(h)}</th>" for h in _HEADER)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
            for cells in _table_rows(points, reference)
        )
        parts.append(
            f"<h3>{html.escape(title)}</h3>{_svg(title, points, reference)}"
            f"<table border='1' cellpadding='4'><tr>{head}</tr>{body}</table>"
        )
    return "\n".join(parts)


def sweep_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the budget sweep (empty without budget rows): one line per (model, seq_len, budget)."""
    groups = sweep_groups(rows)
    if not groups:
        return ""
    header = ("model", "seq", *_HEADER)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (label, seq_len), group in groups.items():
        points, reference = _points(group)
        for cells in _table_rows(points, reference):
            lines.append("| " + " | ".join([label, str(seq_len), *cells]) + " |")
    return "\n".join(lines)
