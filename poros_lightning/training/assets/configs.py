"""The shipped configs, found by name: ``--config qwen2.5-7b`` works from any folder after ``pip install``.

The repository's top-level ``configs/`` folder is installed as the package ``poros_lightning.configs``
(``setup.py`` maps it; its YAML files are package data), so a wheel carries every shipped config. A name that is
not an existing file resolves to the packaged copy: ``qwen2.5-7b``, ``qwen2.5-7b.yaml``, ``configs/qwen2.5-7b.yaml``
and, for the tools, ``parity/qwen2.5-7b`` or ``bench/qwen2.5-7b``.
"""

from __future__ import annotations

from pathlib import Path

from poros_lightning.errors import PorosConfigError

__all__ = ["KINDS", "bundled_configs", "configs_dir", "resolve_config", "resolve_config_args"]

KINDS: tuple[str, ...] = ("", "bench", "parity")
"""Config kinds: ``""`` for LightningCLI (fit, demo), and the subfolders read by ``bench run`` and ``parity``."""

_SUFFIXES = (".yaml", ".yml")


def configs_dir() -> Path:
    """The folder of the shipped configs.

    Installed from a wheel, it is the package data folder ``poros_lightning/configs``. Run from a source checkout
    (an editable install, or ``PYTHONPATH=.``), it is the checkout's ``configs/`` beside the package: the folder a
    wheel packages. The package's own folder is looked at first, so an installed package never reads a ``configs``
    folder that something else put in ``site-packages``.
    """
    package = Path(__file__).resolve().parents[2]  # poros_lightning/
    packaged = package / "configs"
    return packaged if packaged.is_dir() else package.parent / "configs"


def bundled_configs(kind: str = "") -> list[str]:
    """Names of the shipped configs of ``kind`` (``""``, ``"bench"`` or ``"parity"``), without ``.yaml``."""
    folder = configs_dir() / kind
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _candidates(name: str, kind: str) -> list[str]:
    name = name.replace("\\", "/").removeprefix("./").removeprefix("configs/")
    if not name.endswith(_SUFFIXES):
        name += ".yaml"
    return [f"{kind}/{name}", name] if kind and not name.startswith(f"{kind}/") else [name]


def resolve_config(value: str | Path, kind: str = "") -> Path:
    """The config file ``value`` names: an existing file as it is, else the shipped config of that name.

    Args:
        value: a path, or a shipped config's name (``qwen2.5-7b``, ``qwen2.5-7b.yaml``, ``configs/qwen2.5-7b.yaml``,
            ``parity/qwen2.5-7b``).
        kind: where a bare name is looked for first: ``""`` (LightningCLI configs), ``"bench"`` or ``"parity"``.

    Raises:
        PorosConfigError: ``value`` is neither an existing file nor a shipped config.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = Path(value).expanduser()
    if path.is_file():
        return path
    root = configs_dir()
    for candidate in _candidates(str(value), kind):
        if (root / candidate).is_file():
            return root / candidate
    names = ", ".join(bundled_configs(kind)) or "none found"
    raise PorosConfigError(
        f"Config {str(value)!r} is neither a file nor a shipped config.",
        f"Pass the path of a YAML file, or one of the shipped {kind + ' ' if kind else ''}configs: {names}.",
    )


def _looks_like_a_name(value: str) -> bool:
    # jsonargparse also takes inline YAML for --config ("{trainer: {max_steps: 1}}"): leave that alone.
    return bool(value) and not any(c in value for c in "{}[]:\n")


def _config_value(value: str) -> str:
    if Path(value).expanduser().exists() or not _looks_like_a_name(value):
        return value
    return str(resolve_config(value))


def resolve_config_args(args: list[str]) -> list[str]:
    """``args`` with each ``--config NAME`` (``-c``, ``--config=``) that names a shipped config replaced by its path.

    Raises:
        PorosConfigError: a ``--config`` value is neither a file nor a shipped config.
    """
    out = list(args)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = _config_value(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + _config_value(arg.removeprefix("--config="))
    return out
