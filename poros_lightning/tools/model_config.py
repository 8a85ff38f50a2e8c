"""Where a model's config comes from: a local path, the Hugging Face cache, the bundled facts, or the Hub.

Invariant: resolving never imports torch or transformers and needs the network only for the last resort, a
download of that one ``config.json`` with a short timeout, when online and ``huggingface_hub`` is installed.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from poros_lightning.arch import known_config, known_ids
from poros_lightning.errors import PorosConfigError

__all__ = ["load_config"]

_HUB_TIMEOUT_S = 10.0
_ALIASES = {
    "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"
}  # the bundled demo model of poros_lightning.training.models


def _hub_cache_dir() -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def _from_hf_cache(hub_id: str) -> Path | None:
    repo = _hub_cache_dir() / ("models--" + hub_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = repo / "snapshots" / ref.read_text().strip() / "config.json"
        if candidate.is_file():
            return candidate
    found = sorted((repo / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


def _offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in {"1", "true", "yes", "on"}
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _from_hub(hub_id: str) -> Path | None:
    if _offline():
        return None
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None
    box: dict[str, Any] = {}

    def fetch() -> None:
        try:
            box["path"] = hf_hub_download(hub_id, "config.json", etag_timeout=_HUB_TIMEOUT_S)
        except Exception as err:  # any network, auth or not-found failure means "not available"
            box["error"] = err

    # A daemon thread bounds the wait even where a request ignores its own timeout.
    worker = threading.Thread(target=fetch, daemon=True)
    worker.start()
    worker.join(_HUB_TIMEOUT_S)
    return Path(box["path"]) if "path" in box else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PorosConfigError(f"cannot read {str(path)!r} as JSON: {err}.", hint="pass a valid config.json.") from err
    if not isinstance(data, dict):
        raise PorosConfigError(f"{str(path)!r} is not a config object.", hint="pass a Hugging Face config.json.")
    return data


def load_config(model: str) -> tuple[dict[str, Any], str]:
    """Resolve MODEL to its config dict and say where it came from.

    Raises:
        PorosConfigError: MODEL is neither a readable path nor a hub id found in the cache, the bundled
            facts, or (online) the Hub.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise PorosConfigError(
                f"directory {model!r} has no config.json.",
                hint="pass a Hugging Face model directory or its config.json.",
            )
        return _read_json(config), str(config)
    if path.is_file():
        return _read_json(path), str(path)
    hub_id = _ALIASES.get(model.lower(), model)
    cached = _from_hf_cache(hub_id)
    if cached is not None:
        return _read_json(cached), f"Hugging Face cache ({cached})"
    bundled = known_config(hub_id)
    if bundled is not None:
        return bundled, "bundled config facts"
    fetched = _from_hub(hub_id)
    if fetched is not None:
        return _read_json(fetched), f"Hugging Face Hub ({hub_id})"
    examples = ", ".join(known_ids()[:3])
    raise PorosConfigError(
        f"cannot find a config for {model!r}: not a local path, not in the Hugging Face cache "
        f"({_hub_cache_dir()}), not a bundled checkpoint, and not reachable on the Hub.",
        hint=f"pass a model directory or its config.json, download it (huggingface-cli download {model} "
        f"config.json), or use a bundled id such as {examples}.",
    )
