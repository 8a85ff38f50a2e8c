"""``--results-jsonl PATH``: one JSON row per test, appended as each test ends: the raw record of a GPU run.

A run on the lent GPU machine is committed as what it printed, test by test (``docs/validation/gpu_suite/``):
its outcome, its time, the first line of a failure or the reason of a skip, and the card and versions it ran
on. Rows are appended and flushed one at a time, so a run cut off by its time limit keeps every test that
ended before it. Loaded by ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--results-jsonl",
        metavar="PATH",
        default=None,
        help="append one JSON row per test as it ends (outcome, seconds, message, the card, versions), e.g. "
        "docs/validation/gpu_suite/pytest_gpu_DATE.jsonl",
    )


def _environment() -> dict[str, Any]:
    from poros_lightning.tools.parity.runner import versions

    return versions()  # the card ("gpu") and the versions of torch, transformers, PEFT, Lightning, bitsandbytes


def _message(report: pytest.TestReport) -> str | None:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = str(crash.message) if crash is not None else str(report.longrepr or "")
    return " | ".join(text.splitlines()[:4])[:2000] or None  # the assertion, with what it printed


class ResultsJsonl:
    """Writes the rows; a test's row comes from its call, or from its setup where that failed or skipped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.run = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.command = " ".join(["python -m pytest", *sys.argv[1:]])
        self.environment: dict[str, Any] | None = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if (report.when == "setup" and report.passed) or (report.when == "teardown" and not report.failed):
            return
        if self.environment is None:
            self.environment = _environment()
        row = {
            "run": self.run,
            "test": report.nodeid,
            "phase": report.when,
            "outcome": report.outcome,
            "seconds": round(report.duration, 3),
            "message": _message(report) if not report.passed else None,
            **self.environment,
            "command": self.command,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--results-jsonl", default=None)
    if path:
        config.pluginmanager.register(ResultsJsonl(Path(path)), "results-jsonl")
