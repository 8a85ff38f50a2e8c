"""``poros-lightning check``: config resolution, support verdicts, exit codes, and no torch import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from poros_lightning.arch import known_config, registered
from poros_lightning.errors import PorosConfigError
from poros_lightning.tools.check import check, format_check, load_config, main

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
_LINEAR_ATTN = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
FAMILY_CONFIGS: dict[str, dict] = {
    "qwen2": dict(model_type="qwen2", **_TEXT),
    "qwen3": dict(model_type="qwen3", **_TEXT),
    "qwen3_5_text": dict(model_type="qwen3_5_text", **_TEXT, **_LINEAR_ATTN),
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(_TEXT, **_LINEAR_ATTN)),
    "llama": dict(model_type="llama", **_TEXT),
    "mistral": dict(model_type="mistral", **_TEXT),
    "gemma3_text": dict(model_type="gemma3_text", **_TEXT),
    "gemma3": dict(model_type="gemma3", text_config=_TEXT, vision_config=dict(hidden_size=32, num_hidden_layers=1)),
    "gemma4_text": dict(model_type="gemma4_text", hidden_size_per_layer_input=0, **_TEXT),
    "gemma4": dict(model_type="gemma4", text_config=dict(_TEXT, hidden_size_per_layer_input=0)),
}


@pytest.fixture(autouse=True)
def _offline_empty_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def _write(tmp_path: Path, cfg: dict, name: str = "model") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_fixture_covers_every_registered_type():
    assert set(FAMILY_CONFIGS) == set(registered())


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_check_each_family_from_a_directory_and_a_file(tmp_path, model_type):
    folder = _write(tmp_path, FAMILY_CONFIGS[model_type])
    for target in (folder, folder / "config.json"):
        result = check(str(target), seq_len=64, lora_r=4)
        assert result.supported and result.model_type == model_type
        assert result.family == registered()[model_type].family
        assert result.status == registered()[model_type].status
        assert result.source == str(folder / "config.json")
        assert result.plan is not None and result.plan.nf4_base_bytes > 0
    text = format_check(result)
    for word in ("model_type", "family", "status", "guarantee", "parameters", "NF4 base", "per block", "host RAM"):
        assert word in text


def test_well_known_hub_id_offline(capsys):
    assert main(["Qwen/Qwen2.5-7B-Instruct", "--seq-len", "1024", "--lora-r", "8"]) == 0
    out = capsys.readouterr().out
    assert "bundled config facts" in out and "qwen2" in out and "7.62 B" in out and "seq_len 1024" in out
    # qwen2 is certified by its GPU gates; check names the largest
    assert "certified up to 72B (Qwen/Qwen2.5-72B)" in out and "docs/validation/parity_qwen2.5-72b.jsonl" in out
    assert check("smollm2").model_type == "llama"


def test_hf_cache_is_preferred_and_honours_env(tmp_path, monkeypatch):
    cfg = dict(FAMILY_CONFIGS["qwen3"], num_hidden_layers=3)
    for layout in ("HF_HUB_CACHE", "HF_HOME"):
        root = tmp_path / layout
        repo = root / ("hub" if layout == "HF_HOME" else "") / "models--Qwen--Qwen3-8B"
        (repo / "snapshots" / "abc123").mkdir(parents=True)
        (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(cfg))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("abc123")
        monkeypatch.delenv("HF_HUB_CACHE")
        monkeypatch.setenv(layout, str(root))
        loaded, source = load_config("Qwen/Qwen3-8B")
        assert loaded["num_hidden_layers"] == 3 and "cache" in source
        monkeypatch.delenv(layout)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))


def test_hub_fetch_only_when_online(tmp_path, monkeypatch):
    fetched = _write(tmp_path, FAMILY_CONFIGS["mistral"]) / "config.json"
    calls: list[str] = []

    def hf_hub_download(repo_id, filename, **kwargs):
        calls.append(repo_id)
        return str(fetched)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=hf_hub_download))
    with pytest.raises(PorosConfigError, match="cannot find a config"):
        load_config("someone/private-model")
    assert calls == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    cfg, source = load_config("someone/private-model")
    assert cfg["model_type"] == "mistral" and "Hub" in source and calls == ["someone/private-model"]


def test_unknown_model_type_exits_2(tmp_path, capsys):
    folder = _write(tmp_path, dict(_TEXT, model_type="falcon"))
    assert main([str(folder)]) == 2
    out = capsys.readouterr().out
    assert "not in the poros-lightning architecture registry" in out
    assert "docs/architecture-support.md" in out and "HINT:" in out and "--allow-unlisted" in out
    assert "qwen2" in out and "gemma3" in out
    assert main([str(folder), "--allow-unlisted"]) == 0
    out = capsys.readouterr().out
    assert "layout guessed" in out and "own risk" in out


def test_moe_exits_2(tmp_path, capsys):
    folder = _write(tmp_path, dict(_TEXT, model_type="qwen3_moe", num_experts=8))
    assert main([str(folder), "--allow-unlisted"]) == 2
    assert "fused-expert MoE is out of scope" in capsys.readouterr().out


def test_unresolvable_model_exits_1(capsys):
    assert main(["nobody/nothing-here"]) == 1
    assert "HINT:" in capsys.readouterr().err


def test_vram_budget_report(capsys):
    assert main(["Qwen/Qwen2.5-72B-Instruct", "--vram-budget", "4GB"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit; the smallest budget that would is 7.16 GB (host-side options on)" in out
    assert main(["Qwen/Qwen2.5-72B-Instruct", "--vram-budget", "8GB"]) == 0
    out = capsys.readouterr().out  # fits with host-side options, not with everything else on the device
    assert "8.00 GB: fits (the smallest budget that does: 7.16 GB" in out
    assert "streamed, host-side options off: does not fit at block_size 1 (needs 11.66 GB)" in out
    assert main(["Qwen/Qwen2.5-0.5B-Instruct", "--vram-budget", "24GiB"]) == 0
    assert "streamed, host-side options off: fits at block_size 1" in capsys.readouterr().out
    assert main(["Qwen/Qwen2.5-0.5B-Instruct", "--vram-budget", "lots"]) == 1
    assert "invalid size" in capsys.readouterr().err


def test_link_gbps_decides_what_spare_memory_buys(capsys):
    """A 7B block is link-bound on a PCIe 3.0 link and not at 55 GB/s (Note: [link-bound layers])."""
    assert main(["Qwen/Qwen2.5-7B", "--vram-budget", "4.1GB", "--link-gbps", "12"]) == 0
    out = capsys.readouterr().out
    assert "at 12.0 GB/s" in out and "resident blocks first" in out and "spread over the model" in out
    assert main(["Qwen/Qwen2.5-7B", "--vram-budget", "4.3GB", "--link-gbps", "55"]) == 0
    out = capsys.readouterr().out
    assert "at 55.0 GB/s" in out and "kept activations first" in out and "keep their activations" in out


def test_json_output(capsys):
    assert main(["google/gemma-3-1b-it", "--json", "--block-size", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_type"] == "gemma3_text" and data["family"] == "gemma3" and data["supported"]
    assert data["plan"]["block_size"] == 2 and data["plan"]["num_blocks"] == 13


def test_check_does_not_import_torch(tmp_path):
    folder = _write(tmp_path, FAMILY_CONFIGS["gemma3"])
    code = (
        "import sys\n"
        "from poros_lightning.tools.check import main\n"
        f"assert main([{str(folder)!r}, '--vram-budget', '8GB']) == 0\n"
        "assert main(['Qwen/Qwen2.5-7B', '--json']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    env = dict(os.environ, POROS_LIGHTNING_LIGHT="1", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_text_model_type_names_its_own_gate(capsys):
    """gemma-3-1b is a gemma3_text checkpoint: its guarantee is the text model's gate (Gemma-3-27B's decoder)."""
    assert main(["google/gemma-3-1b-it"]) == 0
    assert "google/gemma-3-27b-it (text model)" in capsys.readouterr().out


def test_certified_family_reports_its_largest_gated_scale(capsys):
    assert main(["mistralai/Mistral-7B-v0.3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "certified" and out["certified_scale"] == "7B"
    assert out["guarantee"].endswith("docs/validation/parity_mistral-7b.jsonl")


def test_vram_budget_shows_the_planners_choice(capsys):
    assert main(["Qwen/Qwen2.5-72B", "--vram-budget", "7.5GB"]) == 0
    out = capsys.readouterr().out
    assert "planner (PorosStrategy(vram_budget=...)" in out and "LM head in host memory" in out
    assert main(["Qwen/Qwen2.5-72B", "--vram-budget", "4GB"]) == 0
    assert "The smallest streamed plan needs about 6.19 GB" in capsys.readouterr().out


def test_refused_budget_names_the_fix_and_prices_a_chunked_loss(capsys):
    # 4 x 2048 tokens: the full logits (12.46 GB) refuse 16 GB; chunks of 512 tokens fit far less.
    assert main(["Qwen/Qwen2.5-7B", "--seq-len", "2048", "--batch-size", "4", "--vram-budget", "16GB"]) == 0
    out = capsys.readouterr().out
    assert "fix: Use vram_budget >= 26.65 GB" in out and "LoRALightningModule(loss_chunk_tokens=512)" in out
    assert "loss_chunk_tokens=512), which needs vram_budget >= 5.63 GB)" in out
    assert main(["Qwen/Qwen2.5-7B", "--seq-len", "2048", "--batch-size", "4", "--loss-chunk-tokens", "512"]) == 0
    assert "smallest budget       5.63 GB" in capsys.readouterr().out


def test_loss_chunk_tokens_plans_one_chunk_of_logits(capsys):
    assert main(["Qwen/Qwen2.5-7B", "--seq-len", "2048"]) == 0
    assert "logits (bf16, fp32 upcast and grad)         3.11 GB" in capsys.readouterr().out
    assert main(["Qwen/Qwen2.5-7B", "--seq-len", "2048", "--loss-chunk-tokens", "256", "--vram-budget", "8GB"]) == 0
    out = capsys.readouterr().out
    assert "389.28 MB (loss in chunks of 256 tokens)" in out
    assert "LM head and loss in chunks of 256 tokens: logits 389.28 MB" in out
    assert (
        check("Qwen/Qwen2.5-7B", seq_len=2048, loss_chunk_tokens=256).plan.streamed_vram_min
        < check("Qwen/Qwen2.5-7B", seq_len=2048).plan.streamed_vram_min
    )
    assert main(["Qwen/Qwen2.5-7B", "--loss-chunk-tokens", "0"]) == 1
    assert "loss_chunk_tokens=0 must be a positive integer" in capsys.readouterr().err


def _strategy_plan(model: str, budget: str | int, seq_len: int):
    """The call ``PorosStrategy(vram_budget=budget)._plan`` makes for a plain LoRA run (batch 1, r16, NF4-dq,
    frozen head) off CUDA, where it measures no link."""
    from poros_lightning.memory.planner import plan_engine

    cfg, _ = load_config(model)
    return plan_engine(
        cfg, budget, seq_len=seq_len, batch_size=1, lora_r=16, quantization="nf4-dq", head_frozen=True, link_gbps=None
    )


# Qwen2.5-7B at seq 2048: 8 GB leaves 2.49 GB (0.8 x its logits) to the allocator, 5.51 GB usable: embeddings,
# LM head and moments in host memory with resident blocks (Note: [headroom]).
@pytest.mark.parametrize(
    ("model", "budget", "seq_len"),
    [("Qwen/Qwen2.5-72B", "16GB", 512), ("Qwen/Qwen2.5-7B", "8GB", 2048), ("Qwen/Qwen2.5-32B", "24GB", 4096)],
)
def test_check_prints_the_strategys_plan(capsys, model, budget, seq_len):
    plan = _strategy_plan(model, budget, seq_len)
    assert main([model, "--vram-budget", budget, "--seq-len", str(seq_len)]) == 0
    out = capsys.readouterr().out
    (options,) = [line for line in out.splitlines() if line.startswith("  options: ")]
    printed = dict(item.split("=") for item in options.removeprefix("  options: ").split())
    expected = {**plan.engine_kwargs(), "optimizer_on_host": plan.optimizer_on_host}
    assert printed == {k: str(v) for k, v in expected.items()}
    assert "\n".join(f"  {line}" for line in plan.explanation) in out
    result = check(model, vram_budget=budget, seq_len=seq_len)
    assert result.engine_options == expected and result.engine_plan == plan.explanation


def test_smallest_budget_has_every_host_side_option_on(capsys):
    """The minimum check prints is the smallest budget the strategy accepts, not the plan with nothing moved out."""
    from poros_lightning.errors import PorosOOMError
    from poros_lightning.memory.planner import format_bytes

    result = check("Qwen/Qwen2.5-72B", vram_budget="16GB")
    assert result.minimum_budget < result.plan.streamed_vram_min
    assert (
        format_bytes(result.minimum_budget) == "7.16 GB" and format_bytes(result.plan.streamed_vram_min) == "11.66 GB"
    )
    smallest = _strategy_plan("Qwen/Qwen2.5-72B", result.minimum_budget, 512)
    assert smallest.embeddings_on_host and smallest.head_on_host and smallest.optimizer_on_host
    assert smallest.inputs_on_host
    with pytest.raises(PorosOOMError) as err:
        _strategy_plan("Qwen/Qwen2.5-72B", result.minimum_budget - 1, 512)
    assert err.value.needed_bytes == result.minimum_budget
    assert main(["Qwen/Qwen2.5-72B"]) == 0  # printed without a budget too
    out = capsys.readouterr().out
    assert "smallest budget       7.16 GB (host-side options on" in out and "VRAM, host-side off" in out


def test_check_plans_block_major_micro_batches(capsys):
    """--micro-batches K: the plan PorosStrategy(micro_batches=K) makes, and the smallest budget for it."""
    from poros_lightning.memory.budget import minimum_budget
    from poros_lightning.memory.planner import format_bytes

    # 3.4 GB: 2.78 GB usable beside 0.62 GB of headroom for a 512-token chunk of logits (Note: [headroom])
    args = ["Qwen/Qwen2.5-7B", "--micro-batches", "16", "--loss-chunk-tokens", "512", "--vram-budget", "3.4GB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "batch 1 x 16 block-major micro-batches" in out
    smallest = minimum_budget(known_config("Qwen/Qwen2.5-7B"), micro_batches=16, loss_chunk_tokens=512)
    assert f"VRAM budget 3.40 GB: fits (the smallest budget that does: {format_bytes(smallest)}" in out
    result = check("Qwen/Qwen2.5-7B", micro_batches=16, loss_chunk_tokens=512)
    assert result.plan.micro_batches == 16 and result.minimum_budget == smallest
