"""Shipped configs are package data: found by name from any folder, in a checkout and in an installed wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from poros_lightning.errors import PorosConfigError
from poros_lightning.tools.demo import DEFAULT_DEMO_CONFIG
from poros_lightning.training.assets.configs import bundled_configs, configs_dir, resolve_config, resolve_config_args

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "configs"


def test_shipped_configs_are_this_checkout_s() -> None:
    assert configs_dir().resolve() == SHIPPED.resolve()
    assert DEFAULT_DEMO_CONFIG.resolve() == (SHIPPED / "demo.yaml").resolve()
    assert set(bundled_configs()) == {p.stem for p in SHIPPED.glob("*.yaml")}
    assert set(bundled_configs("parity")) == {p.stem for p in (SHIPPED / "parity").glob("*.yaml")}


@pytest.mark.parametrize(
    ("value", "kind", "expected"),
    [
        ("qwen2.5-7b", "", "qwen2.5-7b.yaml"),
        ("qwen2.5-7b.yaml", "", "qwen2.5-7b.yaml"),
        ("configs/qwen2.5-7b.yaml", "", "qwen2.5-7b.yaml"),  # the README's spelling, from any folder
        ("parity/qwen2.5-7b", "", "parity/qwen2.5-7b.yaml"),
        ("qwen2.5-7b", "parity", "parity/qwen2.5-7b.yaml"),
        ("parity/qwen2.5-7b", "parity", "parity/qwen2.5-7b.yaml"),
        ("configs/bench/qwen2.5-7b.yaml", "bench", "bench/qwen2.5-7b.yaml"),
        ("qwen2.5-32b-compile", "bench", "bench/qwen2.5-32b-compile.yaml"),
    ],
)
def test_shipped_config_names_resolve(
    value: str, kind: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_config(value, kind) == configs_dir() / expected


def test_an_existing_file_wins_and_an_unknown_name_lists_the_shipped_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2.5-7b.yaml").write_text("model: mine\n")
    assert resolve_config("qwen2.5-7b.yaml") == Path("qwen2.5-7b.yaml")
    with pytest.raises(PorosConfigError, match="neither a file nor a shipped config") as err:
        resolve_config("qwen9-7b", "parity")
    assert "llama-3.2-1b" in err.value.hint


def test_cli_config_arguments_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    tiny = str(configs_dir() / "tiny-cpu.yaml")
    args = ["fit", "--config", "tiny-cpu", "-c", "tiny-cpu.yaml", "--config=configs/tiny-cpu.yaml"]
    assert resolve_config_args(args) == ["fit", "--config", tiny, "-c", tiny, f"--config={tiny}"]
    inline = ["fit", "--config", "{trainer: {max_steps: 1}}"]  # jsonargparse's inline YAML stays as it is
    assert resolve_config_args(inline) == inline
    with pytest.raises(PorosConfigError, match="'nope'"):
        resolve_config_args(["fit", "--config", "nope"])


@pytest.mark.slow
def test_an_installed_wheel_ships_the_configs(tmp_path: Path) -> None:
    """Build the wheel (offline), install it into a folder, and resolve configs from elsewhere, as a user would."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("poros_lightning", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip", "-q"]
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("poros_lightning-*.whl")
    target = tmp_path / "site"
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)], env=env, capture_output=True, text=True
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    code = (
        "import json, sys\n"
        "from poros_lightning.tools.demo import DEFAULT_DEMO_CONFIG\n"
        "from poros_lightning.training.assets import tiny_instruct_path\n"
        "from poros_lightning.training.assets.configs import resolve_config, resolve_config_args\n"
        "import poros_lightning\n"
        "print(json.dumps({'package': poros_lightning.__file__, 'demo': str(DEFAULT_DEMO_CONFIG),\n"
        "    'fit': resolve_config_args(['fit', '--config', 'qwen2.5-7b'])[2],\n"
        "    'parity': str(resolve_config('parity/qwen2.5-7b')), 'bench': str(resolve_config('qwen2.5-7b', 'bench')),\n"
        "    'data': str(tiny_instruct_path('train')), 'heavy': 'torch' in sys.modules}))\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_env = {**os.environ, "PYTHONPATH": str(target), "POROS_LIGHTNING_LIGHT": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=run_env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    packaged = target / "poros_lightning"
    assert Path(got.pop("package")) == packaged / "__init__.py"
    assert not got.pop("heavy")
    expected = {
        "demo": "demo.yaml",
        "fit": "qwen2.5-7b.yaml",
        "parity": "parity/qwen2.5-7b.yaml",
        "bench": "bench/qwen2.5-7b.yaml",
    }
    for key, name in expected.items():
        path = Path(got[key])
        assert path == packaged / "configs" / name, (key, path)
        assert path.read_bytes() == (SHIPPED / name).read_bytes()
    assert Path(got["data"]).is_file() and Path(got["data"]).is_relative_to(packaged)
