"""``poros-lightning parity --config``: the gate from a YAML file, on CPU, both ways of building the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from poros_lightning.errors import PorosConfigError
from poros_lightning.tools.parity.cli import load_parity_config, main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "parity" / "tiny-cpu.yaml"


def _config(tmp_path: Path, **edits: object) -> Path:
    cfg = {**yaml.safe_load(TINY.read_text()), "out": str(tmp_path / "parity.jsonl"), **edits}
    path = tmp_path / "parity.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("build", ["direct", "blockwise"])
def test_parity_cli_gates_a_tiny_model(tmp_path: Path, build: str, capsys: pytest.CaptureFixture) -> None:
    path = _config(tmp_path, build=build, steps=2, block_sizes=[1])
    assert main(["--config", str(path)]) == 0
    assert "EQUAL" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "parity.jsonl").read_text().splitlines()]
    summary = [r for r in rows if r.get("summary")]
    assert len(summary) == 1
    assert summary[0]["build"] == build
    assert summary[0]["surfaces"] == dict.fromkeys(("loss", "grad_norm", "adapter", "optimizer"), True)
    assert sum(1 for r in rows if r.get("surface") == "loss") == 2


def test_unknown_build_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PorosConfigError, match="HINT: Use build: auto"):
        load_parity_config(_config(tmp_path, build="fast"))


def test_compile_mode_is_gated_and_really_compiles(tmp_path: Path) -> None:
    """Each decoder layer under torch.compile in both arms: equal, and not the eager bytes (compile ran)."""
    path = _config(tmp_path, steps=2, block_sizes=[2], modes=["plain", "compile"])
    assert main(["--config", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "parity.jsonl").read_text().splitlines()]
    losses = {
        mode: [r["streamed"] for r in rows if r.get("mode") == mode and r.get("surface") == "loss"]
        for mode in ("plain", "compile")
    }
    assert all(r["equal"] for r in rows if r.get("summary"))
    assert len(losses["compile"]) == 2
    assert losses["compile"] != losses["plain"]  # inductor's kernels round differently from eager ones


def test_min_memory_mode_is_gated_with_its_options_in_effect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Embeddings, LM head, layer inputs and optimizer moments in host memory: all four surfaces equal (with dropout)."""
    from poros_lightning.engine.head import HostHead
    from poros_lightning.engine.offload import InputOffload
    from poros_lightning.engine.optim_state import HostOptimizerState

    calls = {"head": 0, "optimizer": 0, "inputs": 0}
    fetch, to_host, pack = HostHead._fetch, HostOptimizerState.to_host, InputOffload.pack

    def counting_pack(self: InputOffload, index: int, tensor: object) -> object:
        self.min_bytes = 0  # the tiny model's hidden states are below the default threshold
        packed = pack(self, index, tensor)
        calls["inputs"] += packed is not tensor
        return packed

    def counting_fetch(self: HostHead, *args: object) -> object:
        calls["head"] += 1
        return fetch(self, *args)

    def counting_to_host(self: HostOptimizerState) -> int:
        calls["optimizer"] += 1
        return to_host(self)

    monkeypatch.setattr(HostHead, "_fetch", counting_fetch)
    monkeypatch.setattr(HostOptimizerState, "to_host", counting_to_host)
    monkeypatch.setattr(InputOffload, "pack", counting_pack)
    path = _config(tmp_path, steps=2, block_sizes=[1], modes=["min_memory"])
    assert main(["--config", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "parity.jsonl").read_text().splitlines()]
    (summary,) = [r for r in rows if r.get("summary")]
    assert summary["mode"] == "min_memory" and summary["lora_dropout"] == 0.1 and summary["equal"]
    # one head copy and one state round trip per step; each layer's input left for host memory every step
    assert calls["head"] == 2 and calls["optimizer"] == 2 and calls["inputs"] >= 2 * 4


def test_keep_activations_mode_is_gated_without_recompute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The streamed arm's layers keep their activations: equal with dropout, and nothing is recomputed."""
    from poros_lightning.engine import block

    recomputes = []
    contexts = block.LayerStreamer._contexts

    def counting_contexts(self: block.LayerStreamer) -> object:
        recomputes.append(self.keep_from)
        return contexts(self)

    monkeypatch.setattr(block.LayerStreamer, "_contexts", counting_contexts)
    path = _config(tmp_path, steps=2, block_sizes=[1], modes=["keep_activations"])
    assert main(["--config", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "parity.jsonl").read_text().splitlines()]
    (summary,) = [r for r in rows if r.get("summary")]
    assert summary["mode"] == "keep_activations" and summary["lora_dropout"] == 0.1 and summary["equal"]
    assert recomputes == []  # no layer of the streamed arm ran under checkpoint


def test_resident_blocks_mode_is_gated_with_blocks_between_streamed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quarter of the streamed arm's blocks stay resident, spread: equal with dropout."""
    from poros_lightning.engine.slots import SlotRing

    rings: list[SlotRing] = []
    init = SlotRing.__init__

    def recording_init(self: SlotRing, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        rings.append(self)

    monkeypatch.setattr(SlotRing, "__init__", recording_init)
    path = _config(tmp_path, steps=2, block_sizes=[1], modes=["resident_blocks"])
    assert main(["--config", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "parity.jsonl").read_text().splitlines()]
    (summary,) = [r for r in rows if r.get("summary")]
    assert summary["mode"] == "resident_blocks" and summary["lora_dropout"] == 0.1 and summary["equal"]
    (ring,) = rings
    assert ring.resident_at == [2]  # 4 layers: one resident block, between streamed ones


def test_replan_mode_changes_the_plan_before_every_step_and_stays_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept layers and resident blocks change before every step of the streamed arm: equal with dropout."""
    from poros_lightning.tools.parity import runner

    made: list[runner.Replan] = []
    init = runner.Replan.__init__

    def recording_init(self: runner.Replan, *args: object) -> None:
        init(self, *args)
        made.append(self)

    monkeypatch.setattr(runner.Replan, "__init__", recording_init)
    path = _config(tmp_path, steps=5, block_sizes=[1], modes=["replan"])
    assert main(["--config", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "parity.jsonl").read_text().splitlines()]
    (summary,) = [r for r in rows if r.get("summary")]
    assert summary["mode"] == "replan" and summary["lora_dropout"] == 0.1 and summary["equal"]
    (replan,) = made
    assert replan.seen == [(0, 0), (2, 1), (4, 0), (0, 2), (1, 2)]  # 4 layers, 4 blocks: a new plan every step


# ------------------------------------------------------------------ any config: nested, defaulted, refused

_GEMMA3_MULTIMODAL = {
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 512,
        "sliding_window": 8,
    },
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    },
    "mm_tokens_per_image": 4,
}
# No vocab_size: the transformers default (248320) applies, as in a config that leaves it out.
_QWEN3_5_TEXT_DEFAULTED = {
    "model_type": "qwen3_5_text",
    "num_hidden_layers": 4,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}


@pytest.mark.parametrize(
    ("model_config", "extra", "model_class"),
    [
        (_GEMMA3_MULTIMODAL, {}, "Gemma3ForConditionalGeneration"),
        (_GEMMA3_MULTIMODAL, {"text_only": True}, "Gemma3ForCausalLM"),
        (_QWEN3_5_TEXT_DEFAULTED, {}, "Qwen3_5ForCausalLM"),
    ],
    ids=["gemma3-text_config-nested", "gemma3-text_only", "qwen3_5_text-no-vocab_size"],
)
def test_parity_reads_any_config(
    tmp_path: Path,
    model_config: dict,
    extra: dict,
    model_class: str,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A multimodal config (text facts under text_config), its text model alone (``text_only``), and one leaving
    vocab_size to transformers: each gates."""
    import poros_lightning.tools.parity.runner as runner

    built: list[str] = []
    build = runner.build_peft_model

    def recording(*args: object, **kwargs: object) -> object:
        net = build(*args, **kwargs)
        built.append(type(net.get_base_model()).__name__)
        return net

    monkeypatch.setattr(runner, "build_peft_model", recording)
    path = tmp_path / "parity.yaml"
    out = tmp_path / "parity.jsonl"
    path.write_text(
        yaml.safe_dump(
            {
                "model_config": model_config,
                "steps": 2,
                "seq_len": 16,
                "lora_r": 4,
                "modes": ["dropout"],
                "out": str(out),
                **extra,
            }
        )
    )
    assert main(["--config", str(path)]) == 0
    assert "EQUAL" in capsys.readouterr().out
    assert built == [model_class]
    (summary,) = [r for r in map(json.loads, out.read_text().splitlines()) if r.get("summary")]
    assert summary["equal"] and summary["lora_dropout"] == 0.1
    assert summary["model_type"] == ("gemma3_text" if extra else model_config["model_type"])


def test_text_only_needs_a_multimodal_config() -> None:
    from poros_lightning.tools.parity.cli import text_only

    with pytest.raises(PorosConfigError, match="needs a multimodal config"):
        text_only(_QWEN3_5_TEXT_DEFAULTED, "tiny")


def test_parity_builds_the_multimodal_class_of_the_checkpoint() -> None:
    """qwen3_5 checkpoints load as Qwen3_5ForConditionalGeneration; AutoModelForCausalLM would drop the vision tower."""
    from poros_lightning.tools.parity.build import build_peft_model

    cfg = {
        "model_type": "qwen3_5",
        "text_config": {k: v for k, v in _QWEN3_5_TEXT_DEFAULTED.items() if k != "model_type"} | {"vocab_size": 256},
        "vision_config": {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "patch_size": 14,
        },
    }
    net = build_peft_model(cfg, lora_r=4)
    assert type(net.get_base_model()).__name__ == "Qwen3_5ForConditionalGeneration"


@pytest.mark.parametrize(
    ("model_config", "match"),
    [
        ({"model_type": "nosuchmodel", "num_hidden_layers": 2}, "does not know model_type 'nosuchmodel'"),
        ({"num_hidden_layers": 2}, "needs a 'model_type' string"),
        (
            {
                "model_type": "qwen2",
                "num_hidden_layers": 1,
                "hidden_size": 32,
                "num_attention_heads": 2,
                "rope_scaling": {"rope_type": "bogus"},
            },
            "cannot build a 'qwen2' model",
        ),
        ({"model_type": "llama", "hidden_size": "wide"}, "transformers cannot build a 'llama' config"),
    ],
)
def test_a_config_transformers_cannot_build_is_a_clear_error(tmp_path: Path, model_config: dict, match: str) -> None:
    path = tmp_path / "parity.yaml"
    path.write_text(yaml.safe_dump({"model_config": model_config, "steps": 1, "seq_len": 8, "lora_r": 2}))
    with pytest.raises(PorosConfigError, match=match) as err:
        main(["--config", str(path)])
    assert "HINT:" in str(err.value)
