"""The poros-lightning command: LightningCLI fit end to end, clear errors for bad configs, tool dispatch, demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from poros_lightning.cli import main
from poros_lightning.tools.demo import DemoResult, DemoSample, format_demo, is_right, run_demo

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "poros_lightning.cli", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def bad_config(tmp_path: Path, edit) -> Path:
    config = yaml.safe_load(TINY.read_text())
    edit(config)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# Third-party output a user cannot act on (poros_lightning._quiet), and Lightning's warning about its own CLI usage.
NOISE = (
    "FutureWarning",
    "💡 Tip",
    "tensorboardX",
    "LeafSpec",
    "args parameter",
    "Failed to load CPU gemm_4bit_forward",
)


def test_fit_tiny_cpu_config_end_to_end(tmp_path: Path) -> None:
    result = run_cli(
        "fit",
        "--config",
        "tiny-cpu",  # a shipped config, by name
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=1",
        "--save_adapter",
        str(tmp_path / "a"),
        "--resume",
        "auto",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (ckpt,) = tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state)
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["r"] == 8
    assert (tmp_path / "lightning_logs" / "version_0" / "config.yaml").is_file()
    # Exact-resume checkpoints by default, under default_root_dir; --resume auto said it found none.
    assert (tmp_path / "checkpoints" / "step-2" / "adapter.safetensors").is_file()
    assert f"--resume auto: no PorosCheckpoint checkpoint in {tmp_path / 'checkpoints'}" in result.stderr
    assert "starting a fresh run" in result.stderr
    noise = [n for n in NOISE if n in result.stderr]
    assert not noise, result.stderr[-3000:]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda c: c["model"].update(lora_rank=8), "lora_rank"),
        (lambda c: c["model"].update(lora_r="eight"), "lora_r"),
        (lambda c: c["data"].update(batch_sise=2), "batch_sise"),
    ],
    ids=["unknown-key", "wrong-type", "unknown-data-key"],
)
def test_bad_config_is_a_parser_error(tmp_path: Path, edit, expected: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(bad_config(tmp_path, edit))])
    assert exit_info.value.code != 0
    assert expected in capsys.readouterr().err


def test_unsupported_model_type_fails_with_a_hint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = bad_config(tmp_path, lambda c: c["model"]["model_config"].update(model_type="mamba9"))
    assert main(["fit", "--config", str(path), f"--trainer.default_root_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "'mamba9' is not in the poros-lightning architecture registry" in err and "HINT:" in err


def test_bad_value_fails_at_construction(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = bad_config(tmp_path, lambda c: c["model"].update(quantization="int3"))
    assert main(["fit", "--config", str(path), f"--trainer.default_root_dir={tmp_path}"]) == 1
    assert "Unknown quantization 'int3'" in capsys.readouterr().err


def _checkpoint_callbacks(config: dict, *dirpaths: str) -> None:
    config["trainer"]["callbacks"] = [
        {"class_path": "poros_lightning.PorosCheckpoint", "init_args": {"dirpath": d}} for d in dirpaths
    ]


@pytest.mark.parametrize(
    ("command", "args", "edit", "expected"),
    [
        ("fit", ["--resume", "empty"], None, "No loadable checkpoint under empty."),
        ("fit", ["--resume", "ckpt/step-3"], None, "resume takes the directory holding them, ckpt."),
        ("fit", ["--resume", "missing"], None, "--resume 'missing' is neither 'auto' nor an existing directory."),
        ("fit", ["--resume", ""], None, "--resume '' is neither 'auto' nor an existing directory."),
        ("fit", ["--resume", "auto", "--ckpt_path", "last.ckpt"], None, "are both set"),
        ("validate", ["--resume", "auto"], None, "--resume is an option of 'poros-lightning fit' only"),
        ("fit", ["--resume", "auto"], lambda c: _checkpoint_callbacks(c, "a", "b"), "2 PorosCheckpoint callbacks"),
    ],
    ids=["no-checkpoint", "one-checkpoint", "not-a-dir", "empty", "with-ckpt-path", "not-fit", "two-callbacks"],
)
def test_bad_resume_fails_with_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, command, args, edit, expected
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()  # exists, holds no step-<N>/ directory
    (tmp_path / "ckpt" / "step-3").mkdir(parents=True)  # one checkpoint, not the directory holding them
    config = bad_config(tmp_path, edit) if edit else TINY
    assert main([command, "--config", str(config), f"--trainer.default_root_dir={tmp_path}", *args]) == 1
    err = capsys.readouterr().err
    assert "poros-lightning: error: " in err and expected in err and "\nHINT: " in err, err[-2000:]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "lightning_logs").exists()  # nothing ran


def test_tools_dispatch_and_missing_tools_are_named(monkeypatch, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--help"])
    assert exit_info.value.code == 0 and "poros-lightning check" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "poros_lightning.tools.export_cli", None)  # as if the module were not shipped
    assert main(["export"]) == 1
    assert "'poros-lightning export' is not available in this build" in capsys.readouterr().err


HEAVY = ("torch", "lightning", "transformers", "peft", "bitsandbytes")
TOOL_HELP = (["--help"], ["check", "--help"], ["doctor", "--help"], ["export", "--help"], ["bench", "--help"],
             ["bench", "run", "--help"], ["parity", "--help"], ["demo", "--help"], ["--version"])  # fmt: skip


def test_help_and_the_tools_help_import_no_torch(tmp_path: Path) -> None:
    """``--help`` and every non-training command's ``--help`` answer without importing torch or Lightning."""
    # As the console script runs: sys.argv[0] is the script `poros-lightning` when the package is imported.
    code = (
        "import sys; sys.argv = ['/venv/bin/poros-lightning']\n"
        "from poros_lightning.cli import main\n"
        f"for args in {TOOL_HELP!r}:\n"
        "    try:\n"
        "        assert main(args) == 0, args\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0, args\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "[]", out.stderr[-2000:]
    assert "poros-lightning COMMAND" in out.stdout and "qwen2.5-7b" in out.stdout  # the commands and shipped configs
    # `python -m poros_lightning.cli --help`: the module path (the package is imported while sys.argv[0] is "-m").
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "poros_lightning.cli", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "commands:" in result.stdout, result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import")}
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_a_library_import_registers_the_strategies(tmp_path: Path) -> None:
    """Outside the console script, ``import poros_lightning`` registers "poros" for ``Trainer(strategy="poros")``."""
    code = (
        "import poros_lightning\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print('poros' in StrategyRegistry, 'poros_ddp' in StrategyRegistry)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_importing_the_cli_for_check_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys; sys.argv = ['poros-lightning', 'check']; import poros_lightning.cli; print('torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_run_demo_reports_before_and_after(tmp_path: Path) -> None:
    lines: list[str] = []
    result = run_demo(
        TINY,
        tmp_path / "run",
        max_steps=2,
        num_samples=2,
        max_new_tokens=3,
        extra_args=["--trainer.limit_val_batches=1"],
        progress=lines.append,
    )
    assert result.steps == 2 and len(result.train_losses) == 2
    assert any(line.startswith("training") for line in lines)
    assert set(result.val_before) >= {"val/loss", "val/ppl", "val/token_acc"}
    assert len(result.samples) == 2 and result.samples[0].reference.startswith("Answer:")
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()
    assert result.loss_curve is None or result.loss_curve.is_file()
    report = format_demo(result)
    assert "val/loss" in report and "before" in report and str(result.adapter_dir) in report
    assert f"held-out answers right: {result.right_before}/2 before, {result.right_after}/2 after" in report


@pytest.mark.parametrize(
    ("reply", "right"),
    [
        ("Answer: 15 cookies. Reason: 7 + 8 = 15.", True),
        ("Answer: 15 cookies", True),  # cut off by the generation length
        ("Answer: 15. Reason: 7 + 8 = 15.", False),  # the field is compared exactly
        ("Answer: 16 cookies. Reason: 15 cookies is wrong.", False),  # the field decides, not the rest
        ("Ravi has 15 cookies now.", True),  # no field: the reference answer anywhere, as a phrase
        ("Ravi has 150 cookies now.", False),
        ("Ravi has 15 apples.", False),
    ],
)
def test_demo_scores_an_answer_by_its_field_or_leniently_without_one(reply: str, right: bool) -> None:
    assert is_right(reply, "Answer: 15 cookies. Reason: 7 + 8 = 15.") is right


def test_demo_report_counts_answers_right_before_and_after(tmp_path: Path) -> None:
    ref = "Answer: odd. Reason: 311 ends in 1, and 1 is odd."
    samples = [
        DemoSample("Is 311 even or odd?", ref, "311 is an even number.", "Answer: odd. Reason: 311 ends in 1."),
        DemoSample("Is 311 even or odd?", ref, "It is odd.", "Answer: odd. Reason: 311 ends in 1."),
        DemoSample("Is 311 even or odd?", ref, "Even.", "Answer: even. Reason: 311 ends in 1."),
    ]
    result = DemoResult(tmp_path, tmp_path, 1, 1.0, 1.0, {"val/loss": 2.0}, {"val/loss": 1.0}, samples, tmp_path)
    assert (result.right_before, result.right_after, result.improved) == (1, 2, 1)
    report = format_demo(result)
    assert "held-out answers right: 1/3 before, 2/3 after (1 wrong before and right after)" in report
    assert report.count("[right]") == 3 and report.count("[wrong]") == 3
