"""The parity table of docs/parity.md, generated from the JSONL summaries under docs/validation/.

python -m poros_lightning.tools.parity.report docs/validation/*.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["load_summaries", "parity_table"]

SURFACES = ("loss", "grad_norm", "adapter", "optimizer")


def load_summaries(paths: list[str | Path]) -> list[dict[str, Any]]:
    """Every summary line (``"summary": true``) of the given JSONL files, with its source file."""
    rows = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("summary"):
                    rows.append({**row, "source": Path(path).name})
    return rows


def parity_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per single-device gate, one column per surface (data-parallel runs are skipped)."""
    head = ["model", "scale", "mode", "block size", "steps", "seq", *SURFACES, "GPU", "torch", "file"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "mode" not in r:  # a data-parallel gate (docs/multi-gpu.md)
            continue
        marks = ["equal" if r["surfaces"].get(s) else "**DIFFERENT**" for s in SURFACES]
        cells = [r["model"], r.get("scale", ""), r["mode"], r["block_size"], r["steps"], r.get("seq_len", "")]
        cells += [*marks, r.get("gpu", ""), r.get("torch", ""), r["source"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(parity_table(load_summaries(sys.argv[1:])))
