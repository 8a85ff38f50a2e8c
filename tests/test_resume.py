"""Crash and resume: a SIGKILLed CLI run resumed with ``--resume DIR`` ends torch.equal to an uninterrupted run, and
so does a run stopped and resumed with ``--resume auto`` while DataLoader workers feed it; an interrupted checkpoint
write leaves the previous checkpoint loadable; a mismatched resume is refused."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

import poros_lightning.lightning.checkpoint_files as ckpt_files
from poros_lightning.cli import main
from poros_lightning.errors import PorosConfigError, ResumeMismatchError
from poros_lightning.lightning.checkpoint import PorosCheckpoint, check_identity, load_checkpoint, load_latest
from poros_lightning.lightning.checkpoint_files import write_checkpoint
from poros_lightning.lightning.resume import install_poros_checkpoint
from poros_lightning.training.resumable import ResumableDataLoader, ResumableSampler

ROOT = Path(__file__).resolve().parent.parent
MAX_STEPS = 6  # 3 batches an epoch: a kill after step 2, 3 or 4 resumes mid-epoch, at its end, or past it


def _config(tmp_path: Path, name: str, *, checkpoint: bool = True, num_workers: int = 0) -> Path:
    """A tiny run; ``checkpoint``: a PorosCheckpoint writing every step to ``<name>/ckpt`` (no resume setting)."""
    config = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())
    config["model"].update(lora_dropout=0.1, warmup_steps=3)  # dropout draws RNG; warmup makes the scheduler matter
    config["data"].update(seq_len=64, batch_size=2, max_records=6, num_workers=num_workers)  # 3 batches an epoch
    callback = {
        "class_path": "poros_lightning.PorosCheckpoint",
        "init_args": {"dirpath": str(tmp_path / name / "ckpt"), "every_n_steps": 1},
    }
    config["trainer"].update(
        strategy="poros",
        max_steps=MAX_STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path / name),
        callbacks=[callback] if checkpoint else [],
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(config: Path, cwd: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "poros_lightning.cli", "fit", "--config", str(config), *args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def _latest_step(ckpt: Path) -> int:
    pointer = ckpt / "latest"
    return int(pointer.read_text().strip().split("-")[1]) if pointer.is_file() else 0


def test_sigkilled_cli_run_resumes_bit_identically(tmp_path: Path) -> None:
    reference = _start(_config(tmp_path, "ref"), tmp_path)
    crashed = _start(_config(tmp_path, "crash"), tmp_path)  # both at once: two cores
    kill_after = random.Random().randint(2, 4)
    ckpt = tmp_path / "crash" / "ckpt"
    deadline = time.monotonic() + 300
    while _latest_step(ckpt) < kill_after and crashed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    crashed.send_signal(signal.SIGKILL)
    crashed.wait()
    killed_at = _latest_step(ckpt)
    assert crashed.returncode == -signal.SIGKILL and kill_after <= killed_at < MAX_STEPS, (killed_at, crashed.stderr)
    _finish(_start(_config(tmp_path, "crash"), tmp_path, "--resume", str(ckpt)))  # picks up `latest`
    _finish(reference)
    _assert_same_state(tmp_path / "ref" / "ckpt" / f"step-{MAX_STEPS}", ckpt / f"step-{MAX_STEPS}")


def _assert_same_state(ref: Path, got: Path) -> None:
    """Adapter, optimizer, RNG and scheduler state and the data position are bitwise those of ``ref``."""
    for name in ("adapter.safetensors", "optimizer.safetensors", "rng.safetensors"):
        a, b = load_file(str(ref / name)), load_file(str(got / name))
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a), name
    for name in ("scheduler.json", "optimizer.json", "rng.json"):
        assert (ref / name).read_text() == (got / name).read_text(), name
    position = ("global_step", "epoch", "batches_in_epoch")
    assert [load_checkpoint(got).meta[k] for k in position] == [load_checkpoint(ref).meta[k] for k in position]


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
@pytest.mark.parametrize("stop_at", [2, 4], ids=["mid-epoch-0", "mid-epoch-1"])
def test_resume_auto_with_loader_workers_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_at: int
) -> None:
    # Validation after batch 2 of each epoch: its persistent workers are seeded once per run, by the first validation.
    validate = ["--trainer.limit_val_batches=1", "--trainer.val_check_interval=2"]
    # Without a PorosCheckpoint in the config, `fit` adds one writing <default_root_dir>/checkpoints every 100 steps:
    # the checkpoint at `stop_at` is the one written when training ends (Note: [end of training]).
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(_config(tmp_path, "ref", num_workers=2)), *validate]) == 0  # uninterrupted
    run = str(_config(tmp_path, "run", checkpoint=False, num_workers=2))
    assert main(["fit", "--config", run, *validate, f"--trainer.max_steps={stop_at}", "--resume", "auto"]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    assert _latest_step(checkpoints) == stop_at  # nothing to resume from: it started fresh
    assert main(["fit", "--config", run, *validate, "--resume", "auto"]) == 0
    _assert_same_state(tmp_path / "ref" / "ckpt" / f"step-{MAX_STEPS}", checkpoints / f"step-{MAX_STEPS}")


# ------------------------------------------------------------------------------------------------ atomicity


def _files(step: int) -> dict:
    tensor = torch.full((2, 3), float(step))
    return {
        "adapter.safetensors": {"w": tensor},
        "optimizer.safetensors": {"state.0.exp_avg": tensor},
        "optimizer.json": {"param_groups": [], "state": {}},
        "scheduler.json": {"schedulers": []},
        "rng.safetensors": {"torch.cpu": torch.get_rng_state()},
        "rng.json": {"python": list(random.getstate())},
        "meta.json": {"global_step": step},
    }


def test_interrupted_write_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_checkpoint(tmp_path, 1, _files(1))
    real = ckpt_files._write_tensors

    def crash_on_rng(path: Path, tensors: dict) -> None:
        if path.name == "rng.safetensors":
            path.write_bytes(b"\x00" * 7)  # half-written file
            raise OSError("disk full")
        real(path, tensors)

    monkeypatch.setattr(ckpt_files, "_write_tensors", crash_on_rng)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path, 2, _files(2))
    assert (tmp_path / "step-2.tmp").is_dir() and not (tmp_path / "step-2").exists()
    assert (tmp_path / "latest").read_text().strip() == "step-1"
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 1 and torch.equal(loaded.adapter["w"], torch.full((2, 3), 1.0))


def test_corrupt_or_incomplete_checkpoints_are_skipped(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 1, _files(1), keep_last=5)
    write_checkpoint(tmp_path, 2, _files(2), keep_last=5)
    write_checkpoint(tmp_path, 3, _files(3), keep_last=5)
    (tmp_path / "step-3" / "meta.json").write_text("{not json")  # corrupt, and `latest` points at it
    (tmp_path / "step-2" / "optimizer.safetensors").unlink()  # incomplete
    with pytest.warns(UserWarning, match="Skipping checkpoint") as record:
        loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 1
    assert len(record) == 2


def test_keep_last_prunes_older_checkpoints(tmp_path: Path) -> None:
    for step in range(1, 5):
        write_checkpoint(tmp_path, step, _files(step), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-3", "step-4"]
    assert load_latest(tmp_path / "missing") is None


# ------------------------------------------------------------------------------------------------ identity, data


def _identity(**exact: object) -> dict:
    base = {"model_config_sha256": "abc", "quantization": "nf4-dq", "precision": "32-true", "batch_size": 2}
    return {"exact": {**base, **exact}, "adapter": {"a.lora_A.weight": [8, 64]}, "versions": {}}


def test_a_resume_that_would_not_be_exact_is_refused(tmp_path: Path) -> None:
    check_identity(_identity(), _identity(), tmp_path)
    with pytest.raises(ResumeMismatchError, match="quantization: checkpoint 'nf4-dq', this run 'fp4'") as err:
        check_identity(_identity(), _identity(quantization="fp4"), tmp_path)
    assert "HINT:" in str(err.value)
    other = {**_identity(), "adapter": {"a.lora_A.weight": [16, 64]}}
    with pytest.raises(ResumeMismatchError, match="adapter tensors differ"):
        check_identity(_identity(), other, tmp_path)


def test_resumable_loader_continues_the_same_order() -> None:
    data = list(range(10))

    def batches(loader: ResumableDataLoader) -> list[list[int]]:
        return [b.tolist() for b in loader]

    loader = ResumableDataLoader(data, seed=3, batch_size=3)
    epoch0 = batches(loader)
    loader.sampler.set_epoch(1)
    epoch1 = batches(loader)
    assert sorted(sum(epoch0, [])) == data and epoch0 != epoch1

    resumed = ResumableDataLoader(data, seed=3, batch_size=3)
    resumed.load_state_dict({"epoch": 0, "batches": 2})
    assert batches(resumed) == epoch0[2:]
    resumed.load_state_dict({"epoch": 0, "batches": 4})  # the epoch was finished: the next one starts
    assert batches(resumed) == epoch1
    state = torch.get_rng_state()
    list(ResumableSampler(10, seed=0))
    assert torch.equal(state, torch.get_rng_state())  # the shuffle draws nothing from the global RNG


# ------------------------------------------------------------------------------------------------ CLI defaults


def _trainer(root: Path, *callbacks: object) -> SimpleNamespace:
    """What install_poros_checkpoint reads of a Trainer."""
    return SimpleNamespace(callbacks=list(callbacks), default_root_dir=str(root), loggers=[])


def test_fit_checkpoints_by_default_and_can_opt_out(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    callback = install_poros_checkpoint(trainer, None)
    assert trainer.callbacks == [callback] and callback.dirpath == tmp_path / "checkpoints" and not callback.resume
    own = PorosCheckpoint(tmp_path / "mine")
    trainer = _trainer(tmp_path, own)
    assert install_poros_checkpoint(trainer, True) is own and own.resume is True and trainer.callbacks == [own]
    trainer = _trainer(tmp_path)
    assert install_poros_checkpoint(trainer, None, enabled=False) is None and trainer.callbacks == []
    with pytest.raises(PorosConfigError, match="--no_poros_checkpoint turns them off"):
        install_poros_checkpoint(_trainer(tmp_path), True, enabled=False)


def test_resume_auto_says_it_starts_fresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="poros_lightning"):
        install_poros_checkpoint(_trainer(tmp_path), True)
    checkpoints = tmp_path / "checkpoints"
    expected = (
        f"--resume auto: no PorosCheckpoint checkpoint in {checkpoints} and no Lightning .ckpt: starting a fresh run"
    )
    assert expected in caplog.text


def test_resume_auto_with_only_a_lightning_ckpt_says_how_to_use_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "epoch=0-step=1.ckpt").write_bytes(b"")
    newer = tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "epoch=0-step=2.ckpt"
    newer.parent.mkdir(parents=True)
    newer.write_bytes(b"")
    os.utime(newer, (time.time() + 10, time.time() + 10))
    with caplog.at_level(logging.INFO, logger="poros_lightning"):
        install_poros_checkpoint(_trainer(tmp_path), True)
    assert f"only the Lightning checkpoint {newer} (and 1 older): starting a fresh run" in caplog.text
    assert f"--ckpt_path {newer} in place of --resume auto" in caplog.text
    assert "not bit-exact" in caplog.text


def test_resume_auto_names_the_checkpoint_it_resumes_from(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_checkpoint(tmp_path / "checkpoints", 3, _files(3))
    with caplog.at_level(logging.INFO, logger="poros_lightning"):
        install_poros_checkpoint(_trainer(tmp_path), True)
    assert f"resuming exactly from the PorosCheckpoint {tmp_path / 'checkpoints' / 'step-3'}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="poros_lightning"):
        install_poros_checkpoint(_trainer(tmp_path), None)  # a fresh run into a folder holding an earlier run's
    assert "holds checkpoints of an earlier run (newest: step-3)" in caplog.text and "--resume auto" in caplog.text
