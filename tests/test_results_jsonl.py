"""``--results-jsonl``: the raw record of a run (tests/results_jsonl.py), checked on a run of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

CASES = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="needs a CUDA GPU")
def test_skipped():
    pass
"""


def test_a_row_per_test_as_it_ends(tmp_path: Path) -> None:
    (tmp_path / "test_cases.py").write_text(CASES)
    out = tmp_path / "rows" / "results.jsonl"
    out.parent.mkdir()
    out.write_text('{"kept": true}\n')  # rows are appended: what a file holds stays
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    args = ["-q", "-p", "no:cacheprovider", "-p", "results_jsonl", f"--results-jsonl={out}", "test_cases.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stdout + done.stderr  # one test failed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0] == {"kept": True}
    by_test = {row["test"].split("::")[-1]: row for row in rows[1:]}
    assert set(by_test) == {"test_passes", "test_fails", "test_skipped"} and len(rows) == 4
    assert by_test["test_passes"]["outcome"] == "passed" and by_test["test_passes"]["message"] is None
    assert by_test["test_fails"]["outcome"] == "failed" and "one is not two" in by_test["test_fails"]["message"]
    assert by_test["test_skipped"]["outcome"] == "skipped" and by_test["test_skipped"]["message"] == "needs a CUDA GPU"
    for row in rows[1:]:
        assert row["gpu"] and row["torch"] and row["bitsandbytes"] and row["seconds"] >= 0
        assert row["command"].startswith("python -m pytest") and "--results-jsonl" in row["command"]
