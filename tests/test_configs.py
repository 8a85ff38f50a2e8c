"""Every shipped YAML parses with the real CLI parser, carries its run command, and comments every key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from poros_lightning.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def test_the_expected_configs_ship() -> None:
    names = {p.name for p in CONFIGS}
    assert {"tiny-cpu.yaml", "demo.yaml", "qwen2.5-7b.yaml", "qwen2.5-32b.yaml", "qwen2.5-72b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --print_config validates every key and type against the classes' signatures, then exits without building.
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code in (0, None), capsys.readouterr().err
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["model"]["class_path"].endswith("LoRALightningModule")
    assert resolved["data"]["class_path"].endswith("InstructionDataModule")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_self_documenting(path: Path) -> None:
    lines = path.read_text().splitlines()
    assert re.match(r"# poros-lightning (fit|demo|validate)\b", lines[0]), "first line: the command that runs it"
    uncommented = [line for line in lines if line.strip() and not line.lstrip().startswith("#") and " # " not in line]
    # Parent keys of a block (`model:`, `init_args:`) need no comment; leaves do.
    leaves = [line for line in uncommented if not line.rstrip().endswith(":")]
    assert not leaves, f"keys without a comment: {leaves}"


@pytest.mark.parametrize("name", ["qwen2.5-7b.yaml", "qwen2.5-32b.yaml", "qwen2.5-72b.yaml"])
def test_qwen_configs_stream_with_poros(name: str) -> None:
    config = yaml.safe_load((CONFIGS[0].parent / name).read_text())
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"].endswith("PorosStrategy")
    assert {"block_size", "prefetch"} <= set(strategy["init_args"])
    assert config["trainer"]["accelerator"] == "gpu"
    assert config["model"]["model"].startswith("Qwen/Qwen2.5-")


@pytest.mark.parametrize("name", ["qwen2.5-32b.yaml", "qwen2.5-72b.yaml"])
def test_commented_strategy_options_are_real_options(name: str) -> None:
    """The options a training config shows commented out (`# key: value`) are PorosStrategy arguments."""
    import inspect

    from poros_lightning import PorosStrategy

    params = set(inspect.signature(PorosStrategy.__init__).parameters)
    shown = re.findall(r"^\s+# (\w+): ", (CONFIGS[0].parent / name).read_text(), re.M)
    assert {"vram_budget", "keep_activations", "resident_blocks"} <= set(shown) <= params
