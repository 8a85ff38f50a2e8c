"""``poros-lightning export``: the merged checkpoint holds exactly ``dequantized base + scaling * B @ A``.

Bitwise claims (the float32 export against the trained model's own dequantized weights) are tested with
``torch.equal``; the bfloat16 reload is compared with a tolerance, because merging rounds the sum of the
base weight and the update once, where the adapter model rounds the two products apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ALL_LINEAR, build_peft_model, tiny_config, train_loop

from poros_lightning.errors import PorosConfigError
from poros_lightning.quant import bnb, is_4bit_linear
from poros_lightning.tools.export import export, parse_size
from poros_lightning.tools.export_cli import main
from poros_lightning.training.adapter import TRAINING_INFO, TrainingInfo, read_lora, save_adapter

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(9))


def _save_base(path: Path, seed: int = 0, **overrides: object) -> Path:
    """The bf16 base ``build_peft_model(seed=seed)`` starts from, saved as a Hugging Face directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config(**overrides)
    model_type = cfg.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.bfloat16)
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"from": "base"}')
    (path / "tokenizer.json").write_text('{"from": "base"}')
    return path


def _trained(quantization: str, targets: list[str] | None = None) -> torch.nn.Module:
    model = build_peft_model(lora_dropout=0.0, quantization=quantization, targets=targets)
    train_loop(model)
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("export")
    base = _save_base(root / "base")
    model = _trained("nf4-dq", targets=["q_proj", "v_proj", "down_proj"])  # o_proj etc. stay quantized, unmerged
    adapter = save_adapter(model, root / "adapter")
    (adapter / "tokenizer_config.json").write_text('{"from": "adapter"}')
    with torch.no_grad():
        logits = model(input_ids=IDS).logits.float()
    fp32 = export(adapter, base, root / "fp32", dtype="fp32", max_shard_size="60KB", progress=False)
    return {"root": root, "base": base, "adapter": adapter, "model": model, "logits": logits, "fp32": fp32}


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _dequantized(layer: torch.nn.Module) -> torch.Tensor:
    return bnb().functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)


def test_nf4_export_is_trained_weights_plus_update(setup: dict) -> None:
    """Every weight of the float32 export equals what the trained model computed with, bit for bit."""
    weights, model = _weights(setup["fp32"].out_dir), setup["model"]
    base = model.get_base_model()
    loras, checked = read_lora(setup["adapter"])[1], 0
    for name, module in base.named_modules():
        if not is_4bit_linear(module):
            continue
        key = name.removesuffix(".base_layer")
        expected = _dequantized(module).float()
        if key in loras:
            parent = base.get_submodule(key)
            delta = parent.lora_B["default"].weight.float() @ parent.lora_A["default"].weight.float()
            expected = expected + delta * parent.scaling["default"]
        assert torch.equal(weights[f"{key}.weight"], expected), key
        checked += 1
    assert checked == 4 * 7 and len(loras) == 4 * 3
    original = _weights(setup["base"])
    for key in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.bias",
    ):
        assert torch.equal(weights[key], original[key].float()), key
    assert setup["fp32"].merged == 12 and setup["fp32"].requantized == 28 and setup["fp32"].training_info_found


def test_bf16_export_reloads_close_to_adapter_model(setup: dict) -> None:
    """Tolerance: the merged bf16 model is as close to the exact merge as the adapter model itself is."""
    from transformers import AutoModelForCausalLM

    out = export(setup["adapter"], setup["base"], setup["root"] / "bf16", progress=False)
    assert out.dtype == "bfloat16" and out.shards == 1
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out.out_dir).eval()
        assert merged.dtype == torch.bfloat16
        got = merged(input_ids=IDS).logits.float()
        exact = AutoModelForCausalLM.from_pretrained(setup["fp32"].out_dir, dtype=torch.float32).eval()
        exact = exact(input_ids=IDS).logits
    adapter_err = (setup["logits"] - exact).abs().max().item()  # the adapter model's own bf16 rounding
    merged_err = (got - exact).abs().max().item()
    assert not torch.equal(got, setup["logits"])  # merging rounds: not bitwise
    assert merged_err <= 2 * adapter_err
    assert (got - setup["logits"]).abs().max().item() <= 2e-2 * setup["logits"].abs().max().item()


def test_original_mode_adds_update_to_checkpoint_weights(setup: dict) -> None:
    out = export(setup["adapter"], setup["base"], setup["root"] / "orig", dtype="fp32", merge_into="original",
                 progress=False)  # fmt: skip
    weights, original = _weights(out.out_dir), _weights(setup["base"])
    loras = read_lora(setup["adapter"])[1]
    for key, tensor in original.items():
        module = key.removesuffix(".weight")
        expected = tensor.float() + loras[module].delta() if module in loras else tensor.float()
        assert torch.equal(weights[key], expected), key
    assert out.requantized == 0
    assert "--merge-into original" in (out.out_dir / "README.md").read_text()


def test_unquantized_training_merges_into_bf16_base(tmp_path: Path) -> None:
    """A run without quantization: 'nf4' means the bf16 weights it trained on; close to the adapter model."""
    from transformers import AutoModelForCausalLM

    base = _save_base(tmp_path / "base")
    model = build_peft_model(lora_dropout=0.0, quantization="none").eval()
    torch.manual_seed(4)
    with torch.no_grad():  # a non-zero update without the cost of training
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.05)
    adapter = save_adapter(model, tmp_path / "adapter")
    assert TrainingInfo.read(adapter) == TrainingInfo(quantization="none", compute_dtype="bfloat16", unquantized=())
    out = export(adapter, base, tmp_path / "out", progress=False)
    assert out.requantized == 0 and out.merged == 28
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out.out_dir).eval()(input_ids=IDS).logits.float()
        ref = model(input_ids=IDS).logits.float()
    assert (got - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_layout_side_files_and_model_card(setup: dict) -> None:
    out = setup["fp32"].out_dir
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == setup["fp32"].shards > 1 and sorted(set(index["weight_map"].values())) == files
    per_file = {f: [k for k, v in index["weight_map"].items() if v == f] for f in files}
    for f, keys in per_file.items():  # a tensor larger than the limit gets a file of its own, as in transformers
        assert len(keys) == 1 or (out / f).stat().st_size <= parse_size("60KB") + 8192, f  # + header
    assert set(index["weight_map"]) == set(_weights(setup["base"]))
    assert index["metadata"]["total_size"] == setup["fp32"].total_bytes
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert (out / "generation_config.json").is_file()
    assert json.loads((out / "tokenizer.json").read_text()) == {"from": "base"}
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"from": "adapter"}  # saved with the adapter
    card = (out / "README.md").read_text()
    assert f"base_model: {setup['base']}" in card and "nf4-dq" in card and "--merge-into nf4" in card
    assert not (out.parent / "fp32.tmp").exists()


def test_scaling_matches_peft(tmp_path: Path) -> None:
    """alpha / r, alpha / sqrt(r) with rsLoRA, and per-module alpha and rank patterns, as PEFT computes them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config(num_hidden_layers=1)
    model_type = cfg.pop("model_type")
    for i, extra in enumerate(({"use_rslora": True}, {"alpha_pattern": {"v_proj": 5}, "rank_pattern": {"q_proj": 2}})):
        base = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=ALL_LINEAR, init_lora_weights=False, **extra)
        model = get_peft_model(base, lora)
        model.save_pretrained(tmp_path / str(i))
        loras = read_lora(tmp_path / str(i))[1]
        for name, lora_factors in loras.items():
            assert lora_factors.scaling == model.get_base_model().get_submodule(name).scaling["default"], name
        assert len(loras) == 7


def test_training_info_defaults_and_modes(setup: dict, tmp_path: Path) -> None:
    assert TrainingInfo.read(tmp_path) is None
    for quantization in ("nf4", "fp4"):
        info = TrainingInfo.of_model(build_peft_model(quantization=quantization))
        assert info == TrainingInfo(quantization=quantization)
    (setup["adapter"] / TRAINING_INFO).rename(tmp_path / TRAINING_INFO)
    try:
        out = export(setup["adapter"], setup["base"], tmp_path / "out", dtype="fp32", progress=False)
        assert not out.training_info_found and out.training == TrainingInfo()  # nf4-dq assumed, same bytes
        assert all(torch.equal(a, b) for a, b in zip(_weights(out.out_dir).values(), _weights(setup["fp32"].out_dir).values(), strict=True))  # fmt: skip
    finally:
        (tmp_path / TRAINING_INFO).rename(setup["adapter"] / TRAINING_INFO)


def test_errors_say_what_to_do(setup: dict, tmp_path: Path) -> None:
    adapter, base = setup["adapter"], setup["base"]
    with pytest.raises(PorosConfigError, match="adapter_model.safetensors missing"):
        export(tmp_path, base, tmp_path / "o1", progress=False)
    smaller = _save_base(tmp_path / "small", hidden_size=32, intermediate_size=64)
    with pytest.raises(PorosConfigError, match="base weight") as err:
        export(adapter, smaller, tmp_path / "o2", progress=False)
    assert "HINT: Pass the base the adapter was trained on" in str(err.value)
    shallow = _save_base(tmp_path / "shallow", num_hidden_layers=2)
    with pytest.raises(PorosConfigError, match="not weights of the base"):
        export(adapter, shallow, tmp_path / "o3", progress=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(PorosConfigError, match="--force"):
        export(adapter, base, busy, progress=False)
    assert (busy / "keep.txt").is_file()
    (tmp_path / "busy.tmp").mkdir()  # left over by an interrupted export
    export(adapter, base, busy, progress=False, force=True)
    assert not (busy / "keep.txt").exists() and (busy / "model.safetensors").is_file()
    assert not (tmp_path / "busy.tmp").exists() and not (tmp_path / "busy.old").exists()
    with pytest.raises(PorosConfigError, match="neither a local directory nor in the Hugging Face cache"):
        export(adapter, "nobody/no-such-model", tmp_path / "o4", progress=False)
    with pytest.raises(PorosConfigError, match="Unknown output dtype"):
        export(adapter, base, tmp_path / "o5", dtype="int8", progress=False)


def test_hub_id_resolves_from_local_cache(setup: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--tiny--qwen2" / "snapshots" / ("0" * 40)
    shutil.copytree(setup["base"], snapshot)
    (tmp_path / "hub" / "models--tiny--qwen2" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny--qwen2" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    out = export(setup["adapter"], "tiny/qwen2", tmp_path / "out", dtype="fp32", progress=False)
    assert all(torch.equal(a, b) for a, b in zip(_weights(out.out_dir).values(), _weights(setup["fp32"].out_dir).values(), strict=True))  # fmt: skip
    assert "base_model: tiny/qwen2" in (out.out_dir / "README.md").read_text()


def test_cli(setup: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from poros_lightning.cli import main as cli_main

    argv = [str(setup["adapter"]), "--base", str(setup["base"]), "-o", str(tmp_path / "out"), "--no-progress"]
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["merge_into"] == "nf4" and record["dtype"] == "bfloat16" and record["peak_rss_bytes"] > 0
    assert cli_main(["export", *argv]) == 1  # exists: error, no traceback
    assert "Pass --force" in capsys.readouterr().err
    assert cli_main(["export", *argv, "--force", "--merge-into", "original", "--dtype", "fp16"]) == 0
    assert "original base weights" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float16"
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1GiB") == 2**30 and parse_size(5) == 5
    with pytest.raises(PorosConfigError):
        parse_size("lots")


def test_chunked_copies_are_exact(setup: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors that are only copied or cast move in bounded chunks; chunk boundaries change no byte."""
    import poros_lightning.tools.export as export_module

    monkeypatch.setattr(export_module, "_CHUNK", 998)  # not a multiple of a row: chunks straddle rows
    out = export(setup["adapter"], setup["base"], tmp_path / "out", dtype="fp32", progress=False)
    ours, reference = _weights(out.out_dir), _weights(setup["fp32"].out_dir)
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)


def test_base_from_the_streamed_loader(setup: dict, tmp_path: Path) -> None:
    """A base loaded by quant.loader (as LoRALightningModule loads a model directory): the record says where it
    was quantized, and the export rebuilds its 4-bit weights bit for bit."""
    from peft import LoraConfig, get_peft_model

    from poros_lightning.quant.loader import load_quantized

    base = load_quantized(setup["base"], compute_device="cpu", use_cache=False, progress=False)
    torch.manual_seed(3)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR, init_lora_weights=False))
    adapter = save_adapter(model, tmp_path / "adapter")
    assert TrainingInfo.read(adapter) == TrainingInfo(quantized_on="cpu")
    out = export(adapter, setup["base"], tmp_path / "out", dtype="fp32", progress=False)
    assert out.device == "cpu"
    weights, loras = _weights(out.out_dir), read_lora(adapter)[1]
    for name, module in model.get_base_model().named_modules():
        if is_4bit_linear(module):
            key = name.removesuffix(".base_layer")
            expected = _dequantized(module).float() + loras[key].delta()
            assert torch.equal(weights[f"{key}.weight"], expected), key


def test_failed_export_leaves_nothing(setup: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import poros_lightning.tools.export as export_module

    def broken(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "_copy", broken)
    with pytest.raises(OSError, match="disk full"):
        export(setup["adapter"], setup["base"], tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []
