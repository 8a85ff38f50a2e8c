"""Peers in the bench on CPU: a peer that cannot run is a row saying why and the sweep goes on, the child's row comes
back whole, the checkpoint is the bench's model (written once), and the report shows peers beside our runs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_config

from poros_lightning.errors import PorosConfigError
from poros_lightning.tools.bench.cli import load_bench_config, main
from poros_lightning.tools.bench.peers import run_peer, write_checkpoint

SPEC = {
    "peer": "soup",
    "name": "peer_soup",
    "model": "tiny-qwen2 (random init)",
    "scale": "tiny",
    "checkpoint": None,
    "model_type": "qwen2",
    "vocab": 256,
    "targets": ["q_proj", "v_proj"],
    "seq_len": 16,
    "batch_size": 2,
    "accumulate": 2,
    "lora_r": 4,
    "steps": 2,
    "warmup": 1,
    "seed": 0,
}
CORE = {
    "method",
    "base_method",
    "model",
    "scale",
    "seq_len",
    "batch_size",
    "accumulate",
    "effective_batch",
    "lora_r",
    "steps",
    "warmup",
    "s_per_step",
    "s_per_step_min",
    "tokens_per_s",
    "peak_vram_gb",
    "peak_reserved_gb",
    "oom",
    "refused",
    "peer_version",
    "vram_budget",
    "gpu",
    "torch",
    "transformers",
    "peft",
}


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


@pytest.mark.skipif(not _missing("unsloth"), reason="needs a machine without unsloth")
def test_a_missing_peer_is_a_refused_row_and_the_sweep_goes_on(tmp_path: Path) -> None:
    cfg = {
        "model": "tiny-qwen2",
        "model_config": tiny_config(num_hidden_layers=2),
        "scale": "tiny",
        "seq_lens": [16],
        "lora_r": 4,
        "batch_size": 2,
        "steps": 2,
        "warmup": 1,
        "peer_checkpoints": str(tmp_path / "ckpt"),
        "runs": [
            {"method": "resident_gc"},
            {"method": "peer", "peer": "unsloth", "accumulate": 2},
            {"method": "peer", "peer": "hf_offload", "name": "hf_1GB", "vram_budget": "1GB", "accumulate": 2},
        ],
        "out": str(tmp_path / "bench.jsonl"),
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(path), "--profile"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["resident_gc", "peer_unsloth", "hf_1GB"]
    spec = json.loads((Path(rows[2]["log"]).parent / "spec.json").read_text())
    assert spec["profile"] is True  # --profile reaches the peers' processes
    assert not any(k.startswith("profile_") for r in rows for k in r)  # on CPU: no profile made up
    resident, unsloth, hf = rows
    assert resident["base_method"] == "resident_gc" and resident["s_per_step"] > 0
    assert CORE <= set(unsloth) and CORE <= set(hf)
    assert unsloth["refused"] and not unsloth["oom"] and unsloth["s_per_step"] is None
    assert "unsloth" in unsloth["refusal"] and "not installed" in unsloth["refusal"]
    assert unsloth["base_method"] == "peer" and unsloth["effective_batch"] == 4
    assert hf["vram_budget"] == 1.0 and hf["model"] == resident["model"] and hf["run_id"] == resident["run_id"]
    if _missing("bitsandbytes"):
        assert hf["refused"] and "bitsandbytes" in hf["refusal"]
    elif hf["refused"]:  # bitsandbytes without CPU kernels for NF4: an answer, with its reason
        assert hf["refusal"] and hf["error"]
    else:  # bitsandbytes' CPU kernels: the peer ran end to end
        assert hf["s_per_step"] > 0 and hf["tokens_per_s"] == pytest.approx(4 * 16 / hf["s_per_step"])
        assert math.isfinite(hf["final_loss"]) and hf["peer_version"].startswith("transformers ")


def test_the_child_row_comes_back_whole(tmp_path: Path) -> None:
    """The row the child writes is the row the parent returns; a child past its timeout is a refused row."""
    from poros_lightning.tools.bench.peer_runners import main as child

    spec = {**SPEC, "workdir": str(tmp_path / "work"), "checkpoint": str(tmp_path / "nowhere")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert child(["run-one", "--spec", str(tmp_path / "spec.json"), "--row", str(tmp_path / "row.json")]) == 0
    written = json.loads((tmp_path / "row.json").read_text())
    assert CORE <= set(written) and written["refused"] and written["refusal"]
    assert written["effective_batch"] == 4 and written["peer_version"].startswith("soup-cli ")

    returned = run_peer(spec, timeout_s=120)  # through a process of its own: the same answer, field for field
    assert returned.pop("log") == str(Path(spec["workdir"]) / "peer.log")  # and where its full output is
    log_tail = returned.pop("log_tail")  # a refused row carries what the peer printed last
    assert {**returned, "host_rss_gb": None} == {**written, "host_rss_gb": None}
    printed = (Path(spec["workdir"]) / "peer.log").read_text().splitlines()[-1]
    assert json.loads(printed) == returned  # and the child's last line says it too
    assert log_tail.splitlines()[-1] == printed

    slow = run_peer({**spec, "workdir": str(tmp_path / "slow")}, timeout_s=0.01)
    assert slow["refused"] and slow["refusal"] == "timed out after 0.01 s" and slow["method"] == "peer_soup"


@pytest.mark.skipif(not _missing("unsloth"), reason="needs a machine without unsloth")
def test_an_unnamed_peer_run_is_selected_by_its_row_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--runs peer_unsloth` picks `{method: peer, peer: unsloth}`; a relative `peer_checkpoints` still works."""
    monkeypatch.chdir(tmp_path)
    cfg = {
        "model_config": tiny_config(num_hidden_layers=2),
        "seq_lens": [16],
        "steps": 1,
        "warmup": 0,
        "peer_checkpoints": "ckpt",
        "runs": [{"method": "resident_gc"}, {"method": "peer", "peer": "unsloth"}],
        "out": "bench.jsonl",
    }
    Path("bench.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", "bench.yaml", "--runs", "peer_unsloth"]) == 0
    (row,) = [json.loads(line) for line in Path("bench.jsonl").read_text().splitlines()]
    assert row["method"] == "peer_unsloth" and row["refused"] and "not installed" in row["refusal"]
    assert Path(row["log"]).is_absolute() and Path(row["log"]).is_file()


def test_a_crashing_peer_is_a_refused_row_with_its_error(tmp_path: Path) -> None:
    spec = {**SPEC, "peer": "hf_offload", "name": "hf", "vram_budget": "4GB", "workdir": str(tmp_path / "work")}
    spec["checkpoint"] = str(tmp_path / "no-checkpoint-here")
    row = run_peer(spec, timeout_s=300)
    assert row["refused"] and not row["oom"] and row["s_per_step"] is None and row["vram_budget"] == 4.0
    if not _missing("bitsandbytes"):  # it got as far as loading: the loader's own error, in one line and in full
        assert "\n" not in row["refusal"] and "Traceback" in row["error"]


def test_the_checkpoint_is_the_bench_model_written_once(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from poros_lightning.quant.hf_config import build_from_config, hf_config

    cfg = tiny_config(num_hidden_layers=2)
    path = write_checkpoint(cfg, tmp_path, device="cpu")
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    torch.manual_seed(0)  # the direct build of parity.build, as the bench quantizes it
    built = build_from_config(AutoModelForCausalLM, hf_config(cfg), dtype=torch.bfloat16)
    ours, theirs = built.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"

    stamp = (path / "poros_checkpoint.json").stat().st_mtime_ns
    assert write_checkpoint(cfg, tmp_path, device="cpu") == path  # reused, not rewritten
    assert (path / "poros_checkpoint.json").stat().st_mtime_ns == stamp
    assert write_checkpoint(cfg, tmp_path, device="cpu", seed=1) != path
    assert not list(tmp_path.glob("*.partial"))


def test_peer_runs_are_validated(tmp_path: Path) -> None:
    def load(run: dict) -> None:
        path = tmp_path / "bench.yaml"
        path.write_text(yaml.safe_dump({"model_config": tiny_config(), "runs": [run]}))
        load_bench_config(path)

    load({"method": "peer", "peer": "soup", "accumulate": 4})
    with pytest.raises(PorosConfigError, match="names peer 'axolotl'"):
        load({"method": "peer", "peer": "axolotl"})
    with pytest.raises(PorosConfigError, match="has no vram_budget"):
        load({"method": "peer", "peer": "hf_offload"})
    with pytest.raises(PorosConfigError, match="block_size"):
        load({"method": "peer", "peer": "unsloth", "block_size": 2})
    with pytest.raises(PorosConfigError, match="timeout_s"):
        load({"method": "peer", "peer": "unsloth", "timeout_s": 0})


def test_the_soup_config_is_the_bench_shape() -> None:
    from poros_lightning.tools.bench.peer_soup import soup_config

    cfg = soup_config({**SPEC, "checkpoint": "/ckpt"})
    training = cfg["training"]
    assert cfg["base"] == "/ckpt" and cfg["task"] == "sft" and cfg["data"]["format"] == "pre_tokenized"
    assert training["stream_layers"] is True and training["quantization"] == "4bit"
    assert (training["batch_size"], training["gradient_accumulation_steps"], training["epochs"]) == (2, 2, 1)
    assert training["lora"] == {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def test_a_soup_failure_names_soups_own_error(tmp_path: Path) -> None:
    import os
    import time

    from poros_lightning.tools.bench.peer_soup import soup_crash

    assert soup_crash(tmp_path, 0.0) == ""  # no bundle: nothing to add
    crashes = tmp_path / ".soup-crashes"
    crashes.mkdir()
    old = crashes / "crash_old.crash"
    old.write_text(json.dumps({"error": {"type": "ValueError", "message": "an earlier run"}}))
    os.utime(old, (1.0, 1.0))
    since = time.time() - 1
    assert soup_crash(tmp_path, since) == ""  # older than this run: not its error
    (crashes / "crash_new.crash").write_text(json.dumps({"error": {"type": "RuntimeError", "message": "CUDA error"}}))
    assert soup_crash(tmp_path, since) == ": RuntimeError: CUDA error"
    (crashes / "crash_new.crash").write_text("not json")
    assert soup_crash(tmp_path, since) == ""


FAKE_SOUP = """
import sys

import torch
from transformers import Trainer, TrainingArguments

SEEN = {}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)


def run():  # as `soup train`: asks whether Unsloth is installed, builds a trainer, prints a failure and exits 1
    try:
        import unsloth  # noqa: F401

        SEEN["unsloth"] = True
    except ImportError:
        SEEN["unsloth"] = False
    args = TrainingArguments(output_dir="./output", report_to=[], use_cpu=True)
    trainer = Trainer(model=Model(), args=args)
    SEEN["timed"] = any(type(c).__name__ == "StepTimer" for c in trainer.callback_handler.callbacks)
    try:
        trainer.train()  # no dataset: transformers refuses
    except ValueError:
        sys.exit(1)
"""


def test_soup_trains_without_unsloth_and_its_refusal_names_the_trainers_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Soup's process cannot import Unsloth even where it is installed (Note: [Soup without Unsloth]), only while Soup
    runs; a trainer that fails without a crash bundle is named in the refusal by its own exception."""
    import sys

    from poros_lightning.tools.bench.peer_soup import train_soup

    pkgs = tmp_path / "site"
    (pkgs / "soup_cli").mkdir(parents=True)
    (pkgs / "soup_cli" / "__init__.py").write_text("")
    (pkgs / "soup_cli" / "cli.py").write_text(FAKE_SOUP)
    (pkgs / "unsloth").mkdir()
    (pkgs / "unsloth" / "__init__.py").write_text("")  # installed beside Soup, as on the bench's GPU machine
    monkeypatch.syspath_prepend(str(pkgs))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for name in ("soup_cli", "soup_cli.cli", "unsloth", "unsloth_zoo"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    spec = {**SPEC, "checkpoint": str(tmp_path / "ckpt" / "model")}
    with pytest.raises(RuntimeError) as err:
        train_soup(spec, lambda: None, lambda: None, lambda: {})
    message = str(err.value)
    assert message.startswith("soup train exited with code 1 after 0 timed steps of 2")
    assert message.endswith(": ValueError: Trainer: training requires a train_dataset.")
    seen = sys.modules["soup_cli.cli"].SEEN
    assert seen == {"unsloth": False, "timed": True}
    assert "unsloth" not in sys.modules and "unsloth_zoo" not in sys.modules  # importable again after Soup
    assert (work / "soup.yaml").exists() and (work / "tokenized").is_dir()


def test_soups_profiled_step_comes_after_its_timed_steps_and_is_marked_in_phases() -> None:
    """``--profile``: the callback times ``steps`` steps after the warm-up, then runs one more under the profiler,
    with the four phase marks the trace summary needs (forward start, forward end and backward end before the
    optimizer, update end), untimed."""
    from poros_lightning.tools.bench.peer_soup import _timer

    class FakeProfile:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def start(self) -> None:
            self.calls.append("start")

        def mark(self) -> None:
            self.calls.append("mark")

        def stop(self) -> dict:
            self.calls.append("stop")
            return {"forward_s": 1.0}

    times: list[float] = []
    peaks: dict = {}
    profiler = FakeProfile()
    timer = _timer(lambda: None, lambda: None, lambda: {}, times, peaks, 2, 3, profiler)
    for step in range(2 + 3 + 1):
        timer.on_step_begin(None, None, None)
        timer.on_pre_optimizer_step(None, None, None)
        timer.on_step_end(None, None, None)
        assert profiler.calls == ([] if step < 5 else ["start", "mark", "mark", "mark", "mark", "stop"])
    assert len(times) == 3 and peaks == {"profile_forward_s": 1.0}
    broken = FakeProfile()
    broken.stop = lambda: {}["no trace"]  # type: ignore[method-assign]  # a trace without its phase marks
    peaks.clear()
    timer = _timer(lambda: None, lambda: None, lambda: {}, times, peaks, 0, 1, broken)
    for _ in range(2):
        timer.on_step_begin(None, None, None)
        timer.on_step_end(None, None, None)
    assert peaks == {"profile_error": "KeyError: 'no trace'"}  # the run goes on, its timed steps kept


def _report_rows() -> list[dict]:
    base = {"run_id": "r", "model": "Qwen/Qwen2.5-7B (random init)", "scale": "7B", "seq_len": 512, "source": "x"}
    return [
        {**base, "method": "resident_gc_x4", "base_method": "resident_gc", "s_per_step": 2.0, "tokens_per_s": 4096.0,
         "peak_vram_gb": 9.5, "peak_reserved_gb": 10.0, "vram_budget": None},
        {**base, "method": "poros_16GB_x4", "base_method": "poros", "s_per_step": 3.0, "tokens_per_s": 2730.7,
         "peak_vram_gb": 7.25, "peak_reserved_gb": 8.0, "vram_budget": 16.0, "refused": False, "oom": False},
        {**base, "method": "peer_hf_offload_16GB", "base_method": "peer", "peer": "hf_offload", "s_per_step": 4.0,
         "tokens_per_s": 2048.0, "peak_vram_gb": 11.125, "peak_reserved_gb": 12.5, "vram_budget": 16.0,
         "refused": False, "oom": False, "peer_version": "transformers 5.17.0 + bitsandbytes 0.50.2 + peft 0.21.0"},
        {**base, "method": "peer_unsloth", "base_method": "peer", "peer": "unsloth", "s_per_step": None,
         "refused": True, "oom": False, "refusal": "peer unsloth needs unsloth, not installed here"},
    ]  # fmt: skip


def test_the_report_shows_peers_beside_our_runs() -> None:
    from poros_lightning.tools.bench.report import peers_html, render_html
    from poros_lightning.tools.bench.sweep import sweep_groups

    rows = _report_rows()
    section = peers_html(rows)
    for text in ("resident_gc_x4", "poros_16GB_x4", "peer_hf_offload_16GB (peer)", "2048", "11.1", "12.5", "4.000"):
        assert text in section
    assert "peer_unsloth (7B, seq 512): peer unsloth needs unsloth, not installed here" in section
    assert section in render_html(rows)
    assert all(r["base_method"] != "peer" for group in sweep_groups(rows).values() for r in group)
    assert peers_html(rows[:2]) == ""  # no peer rows: no section
