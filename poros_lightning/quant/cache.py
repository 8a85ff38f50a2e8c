"""NF4 cache: a quantized base written once, verified on every read, rebuilt when stale or damaged.

Also the safetensors I/O the loader and the cache share: streamed writing, and reading with bounded
mapped memory.

Invariant: an entry is read only when its ``manifest.json`` exists, names the same key, and every file
it lists has the size and fingerprint it recorded; with ``verify="full"`` the SHA-256 of every file is
also checked (in threads, while the load runs) before the loaded model is returned. A failed check
never falls back to the entry's bytes: the caller warns with the reason and rebuilds it.

Note: [the key]
    The entry key hashes what the quantized bytes depend on: the source shard names, sizes and
    modification times, the bytes of ``config.json`` and of the shard index, the quantization mode,
    the compute dtype, the kind of device that quantized (CPU and CUDA kernels are each matched
    against a resident load on the same kind of device), the bitsandbytes version and the cache
    format. Hashing the source shards themselves would read the whole bf16 checkpoint (about twice
    the NF4 bytes) on every run; sizes and times catch a re-download or an edit, and a copied
    checkpoint only costs one rebuild.

Note: [mapped reads]
    ``safe_open(...).get_tensor`` returns views into a memory mapping of the whole file, and every
    page a view touches counts in the process's RSS for as long as the mapping lives, which is as
    long as any view of it lives. Files are therefore re-opened for each decoder layer, and every
    tensor that is kept is first copied out (:func:`private_copy`): the mapped pages never exceed
    one layer's bytes, on top of the memory the loaded model owns.

Note: [publishing]
    Files are written into a temporary sibling directory; ``manifest.json`` (with the SHA-256 of
    every file, computed while writing) is written last, then the directory is renamed into place.
    A crash leaves a temporary directory, never a half-written entry under the real name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from poros_lightning.quant.safetensors_io import (
    TensorSpec,
    digest,
    file_sha256,
    iter_layers,
    layer_index,
    plan_shards,
    private_copy,
    quick_digest,
    safetensors_keys,
    shard_name,
    trim_host_memory,
    write_safetensors,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from poros_lightning.quant.skeleton import Skeleton

__all__ = [
    "MANIFEST", "CacheInvalid", "CacheRebuildWarning", "Progress", "TensorSpec", "Verification", "cache_key",
    "check_entry", "default_cache_dir", "discard", "entry_dir", "iter_layers", "layer_index", "plan_shards",
    "private_copy", "read_entry", "safetensors_keys", "shard_name", "source_fingerprint", "trim_host_memory",
    "write_entry", "write_safetensors",
]  # fmt: skip

CACHE_FORMAT = 1
"""Version of the entry layout; a change makes every older entry a miss."""

MANIFEST = "manifest.json"
SHARD_BYTES = 2 << 30
"""Target size of one cache shard; a shard is cut only between decoder layers."""

# What Linear4bit's state dict stores after "<module>.weight." (QuantState.as_dict(packed=True)).
_QUANT_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4",
               "quant_state.bitsandbytes__fp4")  # fmt: skip

Verification = Literal["full", "quick"]
Progress = Callable[[str, int], AbstractContextManager[Callable[[int], None]]]
"""``progress(description, total_bytes)``: a context manager yielding ``advance(nbytes)``."""

log = logging.getLogger(__name__)


class CacheRebuildWarning(UserWarning):
    """An NF4 cache entry was stale or damaged and is being rebuilt from the checkpoint."""


class CacheInvalid(Exception):
    """An entry failed a check; the message is the reason shown to the user."""


def default_cache_dir() -> Path:
    """``$POROS_LIGHTNING_CACHE/nf4``, or ``~/.cache/poros-lightning/nf4``."""
    env = os.environ.get("POROS_LIGHTNING_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "poros-lightning") / "nf4"


# --- the cache ---------------------------------------------------------------------------------------


def source_fingerprint(model_dir: Path, shards: Sequence[Path]) -> dict[str, Any]:
    """What identifies a checkpoint for the cache (see Note: [the key])."""
    index = model_dir / "model.safetensors.index.json"
    return {
        "dir": str(model_dir.resolve()),
        "shards": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in shards],
        "config_sha256": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        "index_sha256": hashlib.sha256(index.read_bytes()).hexdigest() if index.is_file() else None,
    }


def cache_key(fingerprint: dict[str, Any], *, quantization: str, dtype: torch.dtype, device_type: str) -> str:
    """SHA-256 of the source fingerprint and every option the quantized bytes depend on."""
    from poros_lightning.quant import bnb

    payload = {
        "format": CACHE_FORMAT,
        "source": {k: v for k, v in fingerprint.items() if k != "dir"},
        "quantization": quantization,
        "dtype": str(dtype),
        "device_type": device_type,
        "bitsandbytes": bnb().__version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def entry_dir(cache_dir: Path, model_dir: Path, quantization: str, key: str) -> Path:
    """``<cache_dir>/<checkpoint dir name>-<quantization>-<key prefix>``."""
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in model_dir.resolve().name) or "model"
    return cache_dir / f"{name}-{quantization}-{key[:24]}"


def check_entry(entry: Path, key: str) -> dict[str, Any]:
    """The quick checks: the manifest names ``key`` and every file has its recorded size and fingerprint.

    Returns:
        The manifest.

    Raises:
        CacheInvalid: with the reason.
    """
    path = entry / MANIFEST
    if not path.is_file():
        raise CacheInvalid(f"{path} is missing (the entry was never finished)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        fmt, recorded = manifest["format"], manifest["key"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CacheInvalid(f"{path} is unreadable ({type(err).__name__}: {err})") from err
    if fmt != CACHE_FORMAT or recorded != key:
        raise CacheInvalid(f"{path} is for format {fmt}, key {str(recorded)[:16]}...; expected {key[:16]}...")
    for name, info in files.items():
        if not (entry / name).is_file():
            raise CacheInvalid(f"{name} is missing")
        size = (entry / name).stat().st_size
        if size != info["size"]:
            raise CacheInvalid(f"{name} has {size} bytes, the manifest recorded {info['size']} (truncated?)")
        if quick_digest(entry / name) != info["quick"]:
            raise CacheInvalid(f"{name}: the first/last MiB differ from the manifest (file modified)")
    return manifest


class _FullVerification:
    """SHA-256 of every file of an entry, computed in threads while the entry is being read."""

    def __init__(self, entry: Path, manifest: dict[str, Any]) -> None:
        workers = max(1, min(len(manifest["files"]), (os.cpu_count() or 2) // 2, 8))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="poros-nf4-verify")
        self._jobs: dict[str, tuple[str, Future[str]]] = {
            name: (info["sha256"], self._pool.submit(file_sha256, entry / name))
            for name, info in manifest["files"].items()
        }

    def mismatch(self) -> str | None:
        """Wait for the hashes; the reason of the first mismatch, or None when every file matches."""
        for name, (expected, job) in self._jobs.items():
            if job.result() != expected:
                return f"{name}: SHA-256 differs from the manifest (file corrupted)"
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _quant_owner(key: str, four_bit: dict[str, Any]) -> tuple[str, str] | None:
    """``("<module>.weight", part)`` when ``key`` is a 4-bit weight or one of its quant state tensors."""
    if key in four_bit:
        return key, "weight"
    for part in _QUANT_KEYS:
        owner = key[: -len(part) - 1]
        if key.endswith("." + part) and owner in four_bit:
            return owner, part
    return None


def _restore_4bit(sk: Skeleton, owner: str, parts: dict[str, torch.Tensor]) -> None:
    """Rebuild one 4-bit weight from its state-dict entries, as a pre-quantized transformers load does."""
    from poros_lightning.quant import bnb

    if "weight" not in parts or len(parts) < 4:
        raise CacheInvalid(f"{owner}: incomplete quantized weight ({sorted(parts)})")
    weight = parts.pop("weight")
    lin = sk.four_bit[owner]
    param = bnb().nn.Params4bit.from_prequantized(weight, parts, requires_grad=False, device="cpu", module=lin)
    if tuple(param.quant_state.shape) != sk.specs[owner][1]:
        raise CacheInvalid(f"{owner}: shape {tuple(param.quant_state.shape)} in the cache")
    lin.weight = param
    sk.loaded.add(owner)


def read_entry(sk: Skeleton, entry: Path, key: str, verify: Verification, progress: Progress) -> int:
    """Fill the skeleton ``sk`` from a cache entry, one decoder layer at a time.

    Returns:
        Bytes read.

    Raises:
        CacheInvalid: a check failed (the reason is the message); other exceptions mean unreadable files.
    """
    manifest = check_entry(entry, key)
    shards = sorted(n for n in manifest["files"] if n.endswith(".safetensors"))
    full = _FullVerification(entry, manifest) if verify == "full" else None
    read = count = 0
    try:
        with progress("reading NF4 cache", sum(manifest["files"][n]["size"] for n in shards)) as advance:
            for name in shards:
                for f, keys in iter_layers(entry / name, safetensors_keys(entry / name)):
                    pending: dict[str, dict[str, torch.Tensor]] = {}
                    for k in keys:
                        tensor = private_copy(entry / name, k, f.get_tensor(k))
                        n = tensor.numel() * tensor.element_size()
                        read, count = read + n, count + 1
                        advance(n)
                        owner = _quant_owner(k, sk.four_bit)
                        if owner is not None:
                            pending.setdefault(owner[0], {})[owner[1]] = tensor
                        elif k in sk.sites:
                            sk.assign(k, tensor)
                        else:
                            raise CacheInvalid(f"{name} holds {k}, which the model does not have")
                    for owner, parts in pending.items():
                        _restore_4bit(sk, owner, parts)
        if count != manifest.get("tensors"):
            raise CacheInvalid(f"read {count} tensors, the manifest recorded {manifest.get('tensors')}")
        reason = full.mismatch() if full is not None else None
        if reason is not None:
            raise CacheInvalid(reason)
    finally:
        if full is not None:
            full.close()
    return read


def _entry_tensors(sk: Skeleton) -> list[tuple[str, torch.Tensor]]:
    """Every tensor an entry stores, in module order; 4-bit weights in Linear4bit's state-dict layout."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, sites in sk.sites.items():
        module, attr, is_param = sites[0]
        tensor = (module._parameters if is_param else module._buffers)[attr]
        if tensor is None or tensor.device.type == "meta":
            continue
        out.append((name, tensor.detach()))
        if name in sk.four_bit:
            out.extend((f"{name}.{k}", v) for k, v in tensor.quant_state.as_dict(packed=True).items())
    return out


def write_entry(
    sk: Skeleton,
    config: PretrainedConfig,
    entry: Path,
    key: str,
    fingerprint: dict[str, Any],
    options: dict[str, str],
    progress: Progress,
) -> bool:
    """Write a loaded skeleton as the cache entry ``entry`` (see Note: [publishing]).

    Returns:
        False (after a logged warning) when the entry could not be written; the model is unaffected.
    """
    from poros_lightning.quant import bnb

    tensors = _entry_tensors(sk)
    by_name = dict(tensors)
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    shards = plan_shards(specs, [layer_index(s.name) for s in specs], SHARD_BYTES)
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        files: dict[str, dict[str, Any]] = {}
        with progress("writing NF4 cache", sum(s.nbytes for s in specs)) as advance:
            for i, shard in enumerate(shards):

                def stream(shard: list[TensorSpec] = shard) -> Iterator[torch.Tensor]:
                    for spec in shard:
                        yield by_name[spec.name]
                        advance(spec.nbytes)

                name = shard_name(i, len(shards))
                files[name] = write_safetensors(tmp / name, shard, stream(), {"format": "pt"})
        config.to_json_file(tmp / "config.json")
        files["config.json"] = digest(tmp / "config.json")
        manifest = {
            "format": CACHE_FORMAT,
            "key": key,
            "source": fingerprint,
            **options,
            "bitsandbytes": bnb().__version__,
            "files": files,
            "tensors": len(specs),
            "content_sha256": hashlib.sha256("".join(files[n]["sha256"] for n in sorted(files)).encode()).hexdigest(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / f".{MANIFEST}.tmp").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp / f".{MANIFEST}.tmp", tmp / MANIFEST)
        discard(entry)  # a damaged entry under the same key
        try:
            tmp.rename(entry)
        except OSError:  # another process published the same key first; its entry is equivalent
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:
        log.warning("Could not write the NF4 cache entry %s (%s); the next load quantizes again.", entry, err)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return False
    for stale in _prune_stale(entry, manifest):
        log.info("Removed the stale NF4 cache entry %s (built from an older version of the checkpoint).", stale)
    return True


def discard(entry: Path) -> None:
    """Remove an entry (renamed aside first, so a reader never sees it half-deleted)."""
    if not entry.exists():
        return
    trash = entry.with_name(f".trash-{entry.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        entry.rename(trash)
    except OSError:
        trash = entry
    shutil.rmtree(trash, ignore_errors=True)


def _prune_stale(keep: Path, manifest: dict[str, Any]) -> list[Path]:
    """Remove entries of the same checkpoint directory and options under another key: they can never hit again."""
    removed = []
    same = ("quantization", "dtype", "device_type")
    for entry in keep.parent.iterdir():
        if entry == keep or not entry.is_dir() or entry.name.startswith("."):
            continue
        try:
            other = json.loads((entry / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if other.get("source", {}).get("dir") == manifest["source"]["dir"] and all(
            other.get(k) == manifest[k] for k in same
        ):
            discard(entry)
            removed.append(entry)
    return removed
