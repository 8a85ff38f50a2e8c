"""The planner's memory model against measured peaks: every plan a bench row measured, priced again today.

``poros-lightning bench report ROWS.jsonl --estimates`` prints one line per measured plan: the plan the row's budget
gives with the memory model of this version (:func:`~poros_lightning.memory.planner.plan_engine`), with the kept
layers and resident blocks that step ran (the tuner's steps, ``tuned``, else the row's own), beside the allocated
peak the card measured. A row whose host-side options differ from today's plan for its budget is skipped (it
measured another plan), as are rows without a budget or a measured peak. The ratio is the plan's word: at least
1.0 when the model does not under-predict (``docs/planner.md``, "The estimate, plan by plan").

The steps the tuner measured carry their own peaks, all but the first (its forward and backward ran before the
optimizer's first update created the moments); the timed steps after them carry the row's peak (the largest of all
steps), which is compared with the final plan only when no tuned step ran a larger one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["estimate_rows", "estimates_table"]

_HOST_OPTIONS = ("embeddings_on_host", "head_on_host", "optimizer_on_host", "inputs_on_host")


def _config(model: str) -> dict[str, Any] | None:
    from poros_lightning.arch import known_config
    from poros_lightning.quant.hf_config import hf_config

    hub_id = model.replace(" (random init)", "")
    cfg = known_config(hub_id)
    return None if cfg is None else hf_config(cfg).to_dict()


def estimate_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per measured plan: ``run_id``, ``gpu``, ``scale``, ``seq_len``, ``micro_batches``, ``budget_gb``,
    ``keep``, ``resident``, ``estimate_gb``, ``measured_gb`` and ``ratio`` (estimate over measured)."""
    from poros_lightning.errors import PorosOOMError
    from poros_lightning.memory.planner import plan_engine

    out: list[dict[str, Any]] = []
    configs: dict[str, dict[str, Any] | None] = {}
    for row in rows:
        budget, measured = row.get("vram_budget"), row.get("peak_vram_gb")
        if budget is None or not measured or row.get("oom") or row.get("refused") or not row.get("block_mb"):
            continue
        model = str(row.get("model", ""))
        if model not in configs:
            configs[model] = _config(model)
        cfg = configs[model]
        if cfg is None:
            continue
        shape = dict(
            seq_len=int(row["seq_len"]), batch_size=int(row.get("batch_size", 1)), lora_r=int(row.get("lora_r", 16)),
            quantization=row.get("quantization") or "nf4-dq", loss_chunk_tokens=row.get("loss_chunk_tokens"),
            micro_batches=int(row.get("micro_batches") or 1),
        )  # fmt: skip
        try:
            plan = plan_engine(cfg, int(round(budget * 1e9)), **shape)
        except PorosOOMError as err:  # a budget this version refuses: its smallest plan, if the row measured that
            if not err.needed_bytes:
                continue
            plan = plan_engine(cfg, err.needed_bytes, **shape)
        if any(bool(row.get(k)) != bool(getattr(plan, k)) for k in _HOST_OPTIONS):
            continue  # the row measured another plan than today's for its budget
        block = row["block_mb"] * 1e6

        def priced(keep: int, resident: int, plan: Any = plan, block: float = block) -> float:
            return plan.estimate_with(keep, resident, block) / 1e9

        base = {
            "run_id": str(row.get("run_id", ""))[:19],
            "gpu": row.get("gpu"),
            "scale": row.get("scale"),
            "seq_len": row["seq_len"],
            "micro_batches": row.get("micro_batches") or 1,
            "budget_gb": budget,
        }
        final = (int(row.get("keep_activations") or 0), int(row.get("resident_blocks") or 0))
        # Tuned steps without a resident count come from a tuner that moved kept layers only: the row's count. The
        # first step is left out: the optimizer creates its moments in that step's update, so its forward and
        # backward ran without them (at Qwen2.5-32B 1.07 GB, which read the 8 GB plan as 1.43 times its peak).
        tuned = [t for t in (row.get("tuned") or [])[1:] if t.get("peak_allocated_gb")]
        steps = [(t["keep_activations"], t.get("resident_blocks", final[1]), t["peak_allocated_gb"]) for t in tuned]
        if not steps or priced(*final) >= max(priced(k, r) for k, r, _ in steps):
            steps.append((*final, measured))
        for keep, resident, peak in steps:
            estimate = priced(keep, resident)
            out.append({**base, "keep": keep, "resident": resident, "estimate_gb": estimate, "measured_gb": peak,
                        "ratio": estimate / peak})  # fmt: skip
    return out


def estimates_table(rows: Iterable[dict[str, Any]]) -> str:
    """Markdown: :func:`estimate_rows`, then the smallest and largest ratio."""
    priced = estimate_rows(rows)
    if not priced:
        return "No measured plan to price (rows need vram_budget, block_mb and a measured peak)."
    lines = [
        "| run | card | model | seq | k | budget GB | kept layers | resident blocks | estimate GB | allocated GB | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in priced:
        lines.append(
            f"| {p['run_id']} | {p['gpu']} | {p['scale']} | {p['seq_len']} | {p['micro_batches']} | "
            f"{p['budget_gb']:.2f} | {p['keep']} | {p['resident']} | {p['estimate_gb']:.2f} | "
            f"{p['measured_gb']:.2f} | {p['ratio']:.3f} |"
        )
    ratios = [p["ratio"] for p in priced]
    under = sum(r < 1.0 for r in ratios)
    lines.append("")
    lines.append(
        f"{len(ratios)} measured plans: estimate / allocated from {min(ratios):.3f} to {max(ratios):.3f}; "
        f"{under} under 1.0."
    )
    return "\n".join(lines)
