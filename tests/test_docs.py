"""The README and docs/ hold no dead relative links, and every number in the README's tables comes from an artifact.

README table numbers are renderings of JSONL fields under ``docs/benchmarks/`` and ``docs/validation/`` by
``poros_lightning.tools.bench.report`` (``_fmt``: 3 decimals below 10, 1 from 10, ints as is), so a number is accepted
when some artifact value renders to exactly that text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from poros_lightning.tools.bench.report import _fmt, load_rows, ratio_table

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ARTIFACTS = sorted((ROOT / "docs" / "benchmarks").glob("*.jsonl")) + sorted(
    (ROOT / "docs" / "validation").glob("*.jsonl")
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
NUMBER = re.compile(r"^-?\d+(?:\.\d+)?$")
OOM_CELL = re.compile(r"^OOM under (\d+(?:\.\d+)?) GB cap$")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    in_code, found = False, set()
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(_slug(line.lstrip("#")))
    return found


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return LINK.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{page.name}: broken links: {broken}"


def _values(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [v for x in obj.values() for v in _values(x)]
    if isinstance(obj, list):
        return [v for x in obj for v in _values(x)]
    return [obj]


RATIO_BASELINES = ("resident_gc", "resident_gc_compiled", "resident_gc_x4")


def _renderings() -> set[str]:
    """Every text an artifact number renders to (the report's formatting, plus plain ints)."""
    texts: set[str] = set()
    for path in ARTIFACTS:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            for v in _values(json.loads(line)):
                if isinstance(v, bool) or not isinstance(v, int | float):
                    continue
                texts.update({_fmt(v), f"{v:.3f}", f"{v:.1f}", str(v)})
                if float(v).is_integer():
                    texts.add(str(int(v)))
    # The report's ratio tables (means over rounds, ratios to the checkpointed resident run of the same run).
    rows = load_rows([p for p in ARTIFACTS if p.parent.name == "benchmarks"])
    for baseline in RATIO_BASELINES:
        for line in ratio_table(rows, baseline).splitlines()[2:]:
            texts.update(c.strip() for c in line.strip("|").split("|"))
    return texts


def _table_numbers(path: Path) -> list[str]:
    numbers = []
    for line in path.read_text().splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        for cell in (c.strip() for c in line.strip().strip("|").split("|")):
            oom = OOM_CELL.match(cell)
            if oom:
                numbers.append(oom.group(1))
            elif NUMBER.match(cell):
                numbers.append(cell)
    return numbers


def test_artifacts_exist() -> None:
    assert ARTIFACTS, "no JSONL under docs/benchmarks or docs/validation"


def test_readme_table_numbers_come_from_artifacts() -> None:
    numbers = _table_numbers(ROOT / "README.md")
    assert numbers, "the README has no table numbers to check"
    known = _renderings()
    missing = sorted({n for n in numbers if n not in known})
    assert not missing, f"README table numbers found in no JSONL under docs/benchmarks or docs/validation: {missing}"


def test_number_check_rejects_a_made_up_value() -> None:
    assert "123.456" not in _renderings()


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    """CI installs nothing the README does not: a newcomer following the README gets what CI tested."""
    readme = (ROOT / "README.md").read_text().splitlines()
    (command,) = [line.strip() for line in readme if line.startswith("    ") and "-m pytest" in line]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci
    installs = [line for line in ci if "pip install" in line and not line.startswith("#")]
    assert installs == [command], f".ci/run installs what the README does not say: {installs}"


def test_the_support_table_is_generated_from_the_artifacts() -> None:
    """docs/architecture-support.md shows what status.json, the gate files and the bench rows say."""
    from poros_lightning.tools.support_table import render

    text = (ROOT / "docs" / "architecture-support.md").read_text()
    assert render(ROOT) in text, (
        "regenerate: python -m poros_lightning.tools.support_table --write docs/architecture-support.md"
    )
