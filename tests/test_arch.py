"""The architecture registry: layouts match transformers, unsupported models are refused with a useful error."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from poros_lightning.arch import (
    DOC_LINK,
    STANDARD_TARGETS,
    UnlistedArchitectureWarning,
    arch_for_config,
    arch_for_model,
    get_arch,
    known_config,
    known_ids,
    model_shapes,
    registered,
    resolve,
    transformers_knows,
)
from poros_lightning.arch import registry as registry_module
from poros_lightning.arch.status import gates
from poros_lightning.errors import PorosConfigError, UnsupportedArchitectureError

REPO = Path(__file__).resolve().parents[1]

_TEXT = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
_QWEN3_5_TEXT = dict(
    _TEXT, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4
)
_SIGLIP = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
    vision_use_head=False,
)

#: A tiny config of every registered model type (the model class is the one whose config has that model_type).
TINY: dict[str, dict] = {
    "qwen2": dict(model_type="qwen2", **_TEXT),
    "qwen3": dict(model_type="qwen3", **_TEXT),
    "qwen3_5_text": dict(model_type="qwen3_5_text", **_QWEN3_5_TEXT),
    "qwen3_5": dict(
        model_type="qwen3_5",
        text_config=_QWEN3_5_TEXT,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64),
    ),
    "llama": dict(model_type="llama", **_TEXT),
    "mistral": dict(model_type="mistral", **_TEXT),
    "gemma3_text": dict(model_type="gemma3_text", **_TEXT),
    "gemma3": dict(model_type="gemma3", text_config=_TEXT, vision_config=_SIGLIP, mm_tokens_per_image=4),
    "gemma4_text": dict(
        model_type="gemma4_text", global_head_dim=32, hidden_size_per_layer_input=8, vocab_size_per_layer_input=50,
        **_TEXT,
    ),
    "gemma4": dict(
        model_type="gemma4",
        text_config=dict(global_head_dim=32, hidden_size_per_layer_input=0, **_TEXT),
        vision_config=dict(
            hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16,
        ),
        audio_config=None,
    ),
}  # fmt: skip

# Variants that exercise the config-dependent shapes (per-layer head dims, KV sharing, biases, towers).
SHAPE_VARIANTS: dict[str, dict] = {
    **TINY,
    "qwen2_tied": dict(model_type="qwen2", tie_word_embeddings=True, **_TEXT),
    "llama_biases": dict(model_type="llama", attention_bias=True, mlp_bias=True, **_TEXT),
    "gemma4_text_no_ple": dict(model_type="gemma4_text", hidden_size_per_layer_input=0, **_TEXT),
    "gemma4_text_kv_shared": dict(
        model_type="gemma4_text", global_head_dim=32, hidden_size_per_layer_input=8, vocab_size_per_layer_input=50,
        num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True, num_global_key_value_heads=1,
        layer_types=["sliding_attention", "full_attention"] * 3, **dict(_TEXT, num_hidden_layers=6),
    ),
    "gemma3_vision_head": dict(
        model_type="gemma3", text_config=_TEXT, vision_config=dict(_SIGLIP, vision_use_head=True),
        mm_tokens_per_image=4,
    ),
}  # fmt: skip


def _hf_config(cfg: dict):
    from transformers import AutoConfig

    cfg = dict(cfg)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def _build(cfg: dict, device: str = "meta"):
    """The model whose ``config.model_type`` is ``cfg['model_type']``."""
    import torch
    import transformers

    config = _hf_config(cfg)
    with torch.device(device):
        if cfg["model_type"] == "qwen3_5":  # AutoModelForCausalLM would load the text model only
            return transformers.Qwen3_5ForConditionalGeneration(config)
        return transformers.AutoModelForCausalLM.from_config(config)


def test_arch_imports_without_torch():
    code = (
        "import sys; import poros_lightning.arch, poros_lightning.memory.planner; "
        "assert 'torch' not in sys.modules, 'torch'; assert 'transformers' not in sys.modules, 'transformers'"
    )
    env = dict(os.environ, POROS_LIGHTNING_LIGHT="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_registry_covers_the_issue_families():
    families = {spec.family for spec in registered(include_unavailable=True).values()}
    assert families == {"qwen2", "qwen3", "qwen3_5", "llama", "mistral", "gemma3", "gemma4"}
    assert set(TINY) == set(registered(include_unavailable=True))


def test_status_json_is_valid():
    data = json.loads((REPO / "poros_lightning/arch/status.json").read_text())
    for model_type, spec in registered(include_unavailable=True).items():
        assert model_type in data, model_type
        assert spec.status in ("certified", "experimental", "target")
        assert (spec.status == "certified") == bool(gates(model_type)), f"{model_type}: certified iff it has gates"
        for gate in gates(model_type):
            path = REPO / gate.file
            assert path.is_file(), f"{model_type}: gate {gate.file} is not committed"
            summaries = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("summary")]
            assert summaries, f"{gate.file} has no summary line"
            for row in summaries:
                assert row["equal"] and all(row["surfaces"].values()), f"{gate.file}: {row['mode']} not equal"
                assert row["model"] == f"{gate.model} (random init)", (gate.file, row["model"])
                assert row["scale"] == gate.scale, (gate.file, row["scale"])
                assert row.get("model_type", model_type) == model_type, (gate.file, row["model_type"])
            assert gate.params > 0, f"{gate.file}: scale {gate.scale!r} is not a size such as 7B"


def test_check_names_the_largest_gate_of_each_family():
    largest = {t: (s.gate.scale, s.gate.model) for t, s in registered(include_unavailable=True).items() if s.gate}
    assert largest == {
        "qwen2": ("72B", "Qwen/Qwen2.5-72B"),
        "qwen3": ("32B", "Qwen/Qwen3-32B"),
        "qwen3_5": ("27B", "Qwen/Qwen3.5-27B"),
        "qwen3_5_text": ("27B", "Qwen/Qwen3.5-27B (text model)"),
        "llama": ("8B", "meta-llama/Llama-3.1-8B"),
        "mistral": ("7B", "mistralai/Mistral-7B-v0.3"),
        "gemma3": ("27B", "google/gemma-3-27b-it"),
        "gemma3_text": ("27B", "google/gemma-3-27b-it (text model)"),
        "gemma4": ("31B", "google/gemma-4-31B"),
        "gemma4_text": ("31B", "google/gemma-4-31B (text model)"),
    }
    # every registered family is certified at the scale people fine-tune it
    assert {t for t, s in registered(include_unavailable=True).items() if s.status != "certified"} == set()


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_every_registered_family_resolves(model_type):
    if transformers_knows(model_type) is False:
        pytest.skip(f"the installed transformers does not define {model_type}")
    model = _build(TINY[model_type])
    assert model.config.model_type == model_type
    spec = arch_for_model(model)
    assert spec.model_type == model_type and spec.status in ("certified", "experimental")
    layers = resolve(model, spec.layers)
    text_config = model.config.get_text_config()
    assert len(layers) == text_config.num_hidden_layers
    for path in (spec.embed, spec.norm, spec.head):
        resolve(model, path)
    layer_names = {name.rsplit(".", 1)[-1] for name, _ in layers.named_modules()}
    assert set(spec.lora_targets) <= layer_names, set(spec.lora_targets) - layer_names
    # The PEFT regex adapts every target inside the decoder layers and nothing outside them.
    pattern = re.compile(spec.peft_target_modules())
    matched = [name for name, _ in model.named_modules() if pattern.fullmatch(name)]
    assert matched and all(name.startswith(spec.layers + ".") for name in matched)
    assert {name.rsplit(".", 1)[-1] for name in matched} == set(spec.lora_targets)


def test_qwen3_5_targets_cover_both_layer_kinds():
    model = _build(TINY["qwen3_5_text"])
    assert set(model.config.layer_types) == {"linear_attention", "full_attention"}
    targets = set(arch_for_model(model).lora_targets)
    for layer, kind in zip(model.model.layers, model.config.layer_types, strict=True):
        names = {name.rsplit(".", 1)[-1] for name, module in layer.named_modules() if type(module).__name__ == "Linear"}
        assert names <= targets, (kind, names - targets)
        assert ("in_proj_qkv" in names) == (kind == "linear_attention")


def test_arch_for_model_accepts_a_peft_model():
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = _build(TINY["gemma3"], device="cpu")
    spec = arch_for_model(model)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=spec.peft_target_modules()))
    assert arch_for_model(peft_model) == spec
    adapted = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")]
    assert adapted and not any("vision_tower" in name for name in adapted)


@pytest.mark.parametrize("name", sorted(SHAPE_VARIANTS))
def test_shapes_match_transformers(name):
    cfg = SHAPE_VARIANTS[name]
    model = _build(cfg)
    shapes = model_shapes(cfg)
    if cfg["model_type"] == "gemma4":  # towers are not modelled: compare the text model and head
        expected = sum(p.numel() for p in model.model.language_model.parameters())
        assert shapes.notes
    elif cfg["model_type"] == "qwen3_5":  # AutoModelForCausalLM loads the text model only
        expected = sum(p.numel() for p in _build(dict(cfg, model_type="qwen3_5")).model.language_model.parameters())
        expected += 0 if shapes.tied else shapes.head_params
    else:
        expected = sum(p.numel() for p in model.parameters())
    assert shapes.params_total == expected
    linears = sum(len(layer.linears) for layer in shapes.layers)
    assert linears == sum(
        1 for n, m in resolve(model, get_arch(cfg["model_type"]).layers).named_modules() if type(m).__name__ == "Linear"
    )


# Published parameter counts of well-known checkpoints.
PUBLISHED = {
    "Qwen/Qwen2.5-0.5B-Instruct": 494_032_768,
    "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
    "Qwen/Qwen3-8B": 8_190_735_360,
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "meta-llama/Llama-3.2-1B": 1_235_814_400,
    "mistralai/Mistral-7B-v0.3": 7_248_023_552,
    "google/gemma-3-1b-it": 999_885_952,
    "google/gemma-3-4b-it": 4_300_079_472,
    "HuggingFaceTB/SmolLM2-135M-Instruct": 134_515_008,
}


@pytest.mark.parametrize("hub_id", sorted(PUBLISHED))
def test_known_configs_give_published_parameter_counts(hub_id):
    assert model_shapes(known_config(hub_id)).params_total == PUBLISHED[hub_id]


def test_known_configs_are_registered_and_match_transformers():
    for hub_id in known_ids():
        cfg = known_config(hub_id)
        assert arch_for_config(cfg).status in ("certified", "experimental"), hub_id
    for hub_id in ("Qwen/Qwen2.5-14B", "google/gemma-3-27b-it", "meta-llama/Llama-3.2-3B"):
        cfg = known_config(hub_id)
        assert model_shapes(cfg).params_total == sum(p.numel() for p in _build(cfg).parameters()), hub_id
    assert known_config("qwen/qwen2.5-7b-instruct") == known_config("Qwen/Qwen2.5-7B-Instruct")
    assert known_config("no/such-model") is None


def test_unknown_model_type_lists_families_and_doc():
    with pytest.raises(UnsupportedArchitectureError) as info:
        get_arch("falcon")
    message = str(info.value)
    assert "'falcon'" in message and DOC_LINK in message and "HINT:" in message and "allow_unlisted" in message
    for family in ("qwen2", "qwen3", "llama", "mistral", "gemma3"):
        assert family in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5_moe", "deepseek_v3", "olmoe"])
def test_moe_is_refused_even_with_opt_in(model_type):
    for allow in (False, True):
        with pytest.raises(UnsupportedArchitectureError, match="fused-expert MoE is out of scope"):
            get_arch(model_type, allow_unlisted=allow)


def test_moe_variant_of_a_dense_type_is_refused():
    cfg = dict(TINY["gemma4_text"], enable_moe_block=True, num_experts=4)
    with pytest.raises(UnsupportedArchitectureError, match="fused-expert MoE"):
        arch_for_config(cfg, allow_unlisted=True)
    nested = dict(TINY["gemma4"], text_config=dict(TINY["gemma4"]["text_config"], enable_moe_block=True))
    with pytest.raises(UnsupportedArchitectureError, match="enable_moe_block"):
        arch_for_config(nested)
    assert arch_for_config(dict(TINY["qwen2"], num_experts=0)).family == "qwen2"


def test_allow_unlisted_guesses_the_standard_layout_and_warns():
    with pytest.warns(UnlistedArchitectureWarning, match="guessing the standard layout"):
        spec = get_arch("starcoder2", allow_unlisted=True)
    assert spec.status == "experimental" and spec.guessed
    assert (spec.layers, spec.embed, spec.norm, spec.head) == (
        "model.layers",
        "model.embed_tokens",
        "model.norm",
        "lm_head",
    )
    assert spec.lora_targets == STANDARD_TARGETS
    assert "guessed" in spec.notes


def test_status_is_data_driven(monkeypatch):
    statuses = dict(registry_module.statuses())
    small = {"file": "docs/validation/qwen2-small.jsonl", "model": "Qwen/Qwen2.5-0.5B", "scale": "0.5B"}
    big = {"file": "docs/validation/qwen2.jsonl", "model": "Qwen/Qwen2.5-14B", "scale": "14B"}
    monkeypatch.setattr(
        registry_module,
        "statuses",
        lambda: {
            **statuses,
            "llama": {"status": "target", "gates": []},
            "qwen2": {"status": "certified", "gates": [big, small]},
            "qwen3": {"status": "experimental", "gates": []},
        },
    )
    assert get_arch("qwen2").guarantee == (
        "bit-identical to a resident run, gated on GPU up to 14B (Qwen/Qwen2.5-14B): docs/validation/qwen2.jsonl"
    )
    assert get_arch("qwen3").guarantee == "bit-identical on CPU parity tests in CI; no GPU gate yet"
    with pytest.raises(UnsupportedArchitectureError, match="planned but not supported yet"):
        get_arch("llama")
    with pytest.warns(UnlistedArchitectureWarning):
        assert get_arch("llama", allow_unlisted=True).status == "experimental"


def test_resolve_names_the_missing_part():
    model = _build(TINY["llama"])
    assert resolve(model, "model.layers.0.self_attn.q_proj") is model.model.layers[0].self_attn.q_proj
    with pytest.raises(UnsupportedArchitectureError, match="'model' .* has no attribute 'decoder'"):
        resolve(model, "model.decoder.layers")


def test_arch_for_model_checks_the_layout():
    class Fake:
        class config:  # noqa: N801
            model_type = "llama"

    with pytest.raises(UnsupportedArchitectureError, match="has no 'model.layers'"):
        arch_for_model(Fake())


def test_doc_table_matches_the_registry():
    doc = (REPO / DOC_LINK).read_text()
    rows = {}
    for line in doc.splitlines():
        match = re.match(r"\| `(\w+)` \| (\w+) \| `([\w.]+)` \| (\w+) \|", line)
        if match:
            rows[match.group(1)] = match.groups()[1:]
    specs = registered(include_unavailable=True)
    assert set(rows) == set(specs)
    for model_type, spec in specs.items():
        assert rows[model_type] == (spec.family, spec.layers, spec.status), model_type


def test_fast_linear_attention_kernels_are_refused_on_cuda(monkeypatch):
    """Qwen3.5's gates ran transformers' PyTorch reference kernels: with flash-linear-attention installed, the
    streamed run refuses on CUDA, naming the fix (on the CPU transformers never uses them)."""
    import importlib.util

    import torch

    from poros_lightning.api import check_linear_attention_kernels

    if transformers_knows("qwen3_5_text") is False:
        pytest.skip("the installed transformers does not define qwen3_5_text")
    model = _build(TINY["qwen3_5_text"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "fla" else real(name, *a))
    with pytest.raises(PorosConfigError, match="HINT: Uninstall flash-linear-attention"):
        check_linear_attention_kernels(model, torch.device("cuda", 0))
    check_linear_attention_kernels(model, torch.device("cpu"))  # the CPU path is the reference path
    check_linear_attention_kernels(_build(TINY["qwen2"]), torch.device("cuda", 0))  # not a linear-attention model
    monkeypatch.setattr(importlib.util, "find_spec", real)
    check_linear_attention_kernels(model, torch.device("cuda", 0))  # neither package: the reference kernels
    model._use_kernels = True  # what from_pretrained(use_kernels=True) leaves (PreTrainedModel.use_kernels)
    with pytest.raises(PorosConfigError, match="HINT: Load it with from_pretrained"):
        check_linear_attention_kernels(model, torch.device("cuda", 0))
