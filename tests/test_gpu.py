"""GPU gates (run on a CUDA machine; skipped on CPU).

Set ``POROS_ARTIFACTS=DIR`` to keep the raw JSONL: ``DIR/validation/*.jsonl`` and
``DIR/benchmarks/*.jsonl`` (committed copies live under docs/validation and docs/benchmarks).

    POROS_ARTIFACTS=docs CUBLAS_WORKSPACE_CONFIG=:4096:8 pytest -m gpu tests/test_gpu.py
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from poros_lightning.arch.known import known_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _artifacts(tmp_path: Path, kind: str, name: str) -> Path:
    root = Path(os.environ.get("POROS_ARTIFACTS", tmp_path))
    return root / kind / name


def test_parity_1b_dropout(tmp_path: Path) -> None:
    """Four surfaces torch.equal on a >= 1B random-init Qwen2.5 with LoRA dropout, more blocks than slots."""
    from poros_lightning.tools.parity.runner import run_parity

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    config = known_config("Qwen/Qwen2.5-1.5B")
    result = run_parity(
        config,
        model="Qwen/Qwen2.5-1.5B (random init)",
        scale="1.5B",
        steps=int(os.environ.get("POROS_GPU_STEPS", "20")),
        mode="dropout",
        block_size=1,
        seq_len=512,
        out=_artifacts(tmp_path, "validation", "engine_qwen2.5-1.5b_dropout.jsonl"),
    )
    assert result.equal, result.first_mismatch


def test_bench_7b_resident_vs_streamed(tmp_path: Path) -> None:
    """Peak VRAM and s/step at Qwen2.5-7B scale, seq 512, LoRA r16, batch 1, every method on one build."""
    from poros_lightning.tools.bench.harness import bench_methods, measure_h2d, write_jsonl

    config = known_config("Qwen/Qwen2.5-7B")
    h2d = measure_h2d()
    runs = [{"method": "resident"}, {"method": "resident_gc"}, {"method": "poros"}]
    rows = [
        {
            "model": "Qwen/Qwen2.5-7B (random init)",
            "scale": "7B",
            "pinned_peak_h2d_gbps": h2d,
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            **row,
        }
        for row in bench_methods(config, runs, seq_len=512, lora_r=16, steps=8, warmup=3)
    ]
    write_jsonl(rows, _artifacts(tmp_path, "benchmarks", "engine_qwen2.5-7b.jsonl"))
    by = {r["method"]: r for r in rows}
    # streamed training keeps only the resident modules, adapters and two slots on the GPU
    assert by["poros"]["peak_vram_gb"] < 0.5 * by["resident"]["peak_vram_gb"]
    assert by["poros"]["peak_vram_gb"] < by["resident_gc"]["peak_vram_gb"]
    # the copies run at (close to) the pinned bandwidth measured in the same run
    assert by["poros"]["h2d_copy_gbps"] > 0.8 * h2d


def test_min_memory_7b_parity_and_peak(tmp_path: Path) -> None:
    """Embeddings, LM head and optimizer moments in host memory: exact, and the peak drops by about the head."""
    from poros_lightning.tools.bench.harness import bench_methods
    from poros_lightning.tools.parity.runner import run_parity

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    config = known_config("Qwen/Qwen2.5-7B")  # untied: the head can leave the device
    result = run_parity(
        config,
        model="Qwen/Qwen2.5-7B (random init)",
        scale="7B",
        steps=int(os.environ.get("POROS_GPU_STEPS", "5")),
        mode="min_memory",
        seq_len=512,
        out=_artifacts(tmp_path, "validation", "parity_qwen2.5-7b_min_memory.jsonl"),
    )
    assert result.equal, result.first_mismatch
    runs = [
        {"method": "poros", "name": "poros_min", "embeddings_on_host": True},
        {"method": "poros", "name": "poros_min_head", "embeddings_on_host": True, "head_on_host": True},
    ]
    by = {r["method"]: r for r in bench_methods(config, runs, seq_len=512, lora_r=16, steps=3, warmup=2)}
    head_gb = config["vocab_size"] * config["hidden_size"] * 2 / 1e9
    assert by["poros_min_head"]["head_loads_per_step"] == 2
    assert by["poros_min"]["peak_vram_gb"] - by["poros_min_head"]["peak_vram_gb"] > 0.5 * head_gb


def _slow_copies(monkeypatch: pytest.MonkeyPatch, cycles: int = 20_000_000) -> None:
    """Delay every block copy on the copy stream (``torch.cuda._sleep``): a missing wait then reads stale bytes."""
    from poros_lightning.engine.slots import SlotRing

    copy = SlotRing._copy

    def slow(self: SlotRing, block: int, slot: int) -> None:
        if self.use_streams:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                torch.cuda._sleep(cycles)
        copy(self, block, slot)

    monkeypatch.setattr(SlotRing, "_copy", slow)


def _qv_grads(keep: int | None, steps: int = 3, resident: int = 0) -> list[list[torch.Tensor]]:
    """Per-step LoRA grads of a small Qwen2 with LoRA on q/v only (``keep=None``: resident)."""
    from poros_lightning import prepare
    from poros_lightning.tools.parity.build import build_peft_model

    cfg = dict(
        model_type="qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    model = build_peft_model(cfg, device="cuda", lora_r=8, target_modules=["q_proj", "v_proj"])
    if keep is not None:
        model = prepare(model, device="cuda", keep_activations=keep, resident_blocks=resident)
    return _lora_grads(model, vocab=512, seed=3, steps=steps)


def _lora_grads(model: torch.nn.Module, vocab: int, seed: int, steps: int) -> list[list[torch.Tensor]]:
    """Per-step LoRA grads of ``model`` over ``steps`` AdamW steps on random ids of 128 tokens (``seed``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (1, 128), generator=gen).cuda()
        logits = model(input_ids=ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).backward()
        grads.append([p.grad.detach().clone() for p in params])
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return grads


def test_timings_leave_the_waits_on_copies_out_of_the_layers_own_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies slowed down: the forward through the layers waits on them (``block_forward_s`` grows), the layers'
    own time (``compute_s``) and their recomputes' (``recompute_s``, what the tuner weighs a kept layer by) do not
    (Note: [measured plans]). Each is compared with the same steps at full copy speed, the least of three timed
    steps each, after an untimed first step (the process's one-time setup: cuBLAS handles, the 4-bit kernels'
    first calls). A layer of this model is bound by its host's issue, so its time is compared with itself, not
    with a copy's."""
    from poros_lightning import prepare
    from poros_lightning.api import engine_of
    from poros_lightning.tools.parity.build import build_peft_model

    cfg = dict(
        model_type="qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    model = prepare(build_peft_model(cfg, device="cuda", lora_r=8), device="cuda")
    engine = engine_of(model)
    ids = torch.randint(0, 512, (1, 128)).cuda()

    def least_of_three() -> dict[str, float]:
        timed = []
        for _ in range(3):
            engine.time_steps(True)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            timed.append(engine.timings())
            engine.time_steps(False)
        return {key: min(t[key] for t in timed) for key in timed[0]}

    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    fast = least_of_three()
    # each copy waits ~50 ms behind a sleep on the copy stream: well past a layer's own time (1-9 ms on the H100s
    # seen, as the host issues it), so the copies, not the host, bound the slowed forward
    _slow_copies(monkeypatch, cycles=100_000_000)
    slow = least_of_three()
    waits = slow["block_forward_s"] - fast["block_forward_s"]
    seen = {"fast": fast, "slow": slow}
    assert waits > 2e-3, seen  # the forward through the layers waits on the slowed copies
    assert 0 < slow["compute_s"] < fast["compute_s"] + 0.25 * waits, seen
    assert 0 < slow["recompute_s"] < fast["recompute_s"] + 0.25 * waits, seen


@pytest.mark.parametrize(("keep", "resident"), [(0, 0), (6, 0), (0, 2), (2, 2)])
def test_reload_is_ordered_before_a_frozen_linear_under_slow_copies(
    keep: int, resident: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LoRA on q/v only, copies slowed down: the first backward node of a layer (a frozen 4-bit down_proj,
    which saves nothing) still waits for its block (Note: [reload at the output's gradient]); with resident
    blocks between streamed ones, the ring's copies two blocks ahead wait for the slots' last readers."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    ref = _qv_grads(None)
    _slow_copies(monkeypatch)
    got = _qv_grads(keep, resident=resident)
    assert all(torch.equal(a, b) for ra, ga in zip(ref, got, strict=True) for a, b in zip(ra, ga, strict=True))


def _head_grads(on_host: bool, steps: int = 3) -> tuple[list[list[torch.Tensor]], int, int]:
    """LoRA grads of a small untied Qwen2 whose GPU is held back before each head forward (the host runs ahead), and,
    with the head in host memory, what the head's copy stream reserves (bytes) and one head's bytes."""
    from poros_lightning import prepare
    from poros_lightning.api import engine_of
    from poros_lightning.tools.parity.build import build_peft_model

    cfg = dict(
        model_type="qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32768, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    gc.collect()
    torch.cuda.empty_cache()  # streams are pooled: no cached block of an earlier test counts below
    model = build_peft_model(cfg, device="cuda", lora_r=8)
    if on_host:
        model = prepare(model, device="cuda", head_on_host=True)
    model.get_output_embeddings().register_forward_pre_hook(lambda *_: torch.cuda._sleep(50_000_000))
    stream = engine_of(model).host_head.copy_stream.cuda_stream if on_host else None

    def pool() -> int:  # what the copy stream's pool reserves (streams are pooled: measured against the start)
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot() if seg["stream"] == stream)

    before = pool()
    grads = _lora_grads(model, vocab=32768, seed=5, steps=steps)
    if not on_host:
        return grads, 0, 0
    return grads, pool() - before, engine_of(model).host_head.nbytes


def test_the_heads_two_copies_share_one_block_while_the_host_runs_ahead() -> None:
    """The LM head in host memory, the GPU held back ~25 ms before each head forward: the backward's copy reuses the
    forward's freed block, so the copy stream's pool holds one head, not two (Note: [the head's own memory]), and the
    gradients equal a resident head's."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    ref, _, _ = _head_grads(False)
    got, pool, head_bytes = _head_grads(True)
    assert all(torch.equal(a, b) for ra, ga in zip(ref, got, strict=True) for a, b in zip(ra, ga, strict=True))
    assert head_bytes <= pool < 2 * head_bytes, (pool, head_bytes)


def test_slow_copies_negative_control(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the output-gradient reload, the same slowed copies make the q/v-only gradients wrong.

    The copies sleep long enough (about 50 ms each) that the frozen ``down_proj`` of a layer, the first
    node of its backward and one that saves nothing, runs before its block's copy lands however fast the
    host issues the backward: only the output-gradient hook makes the compute stream wait for it
    (Note: [reload at the output's gradient]). Raw runs of this race: docs/validation/gpu_suite/.
    """
    from poros_lightning.engine.block import LayerStreamer

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    ref = _qv_grads(None)
    _slow_copies(monkeypatch, cycles=100_000_000)
    guarded = _qv_grads(0)
    monkeypatch.setattr(LayerStreamer, "_hook_output", lambda self, index, out: out)
    unguarded = _qv_grads(0)
    differing = [
        sum(not torch.equal(a, b) for a, b in zip(ra, ga, strict=True)) for ra, ga in zip(ref, unguarded, strict=True)
    ]
    assert all(torch.equal(a, b) for ra, ga in zip(ref, guarded, strict=True) for a, b in zip(ra, ga, strict=True))
    assert all(n > 0 for n in differing), differing


def test_keep_activations_7b_parity_and_speed(tmp_path: Path) -> None:
    """Every layer keeps its activations (no recompute): exact with dropout, faster, more memory."""
    from poros_lightning.tools.bench.harness import bench_methods
    from poros_lightning.tools.parity.runner import run_parity

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    config = known_config("Qwen/Qwen2.5-7B")
    result = run_parity(
        config,
        model="Qwen/Qwen2.5-7B (random init)",
        scale="7B",
        steps=int(os.environ.get("POROS_GPU_STEPS", "5")),
        mode="keep_activations",
        seq_len=512,
        out=_artifacts(tmp_path, "validation", "parity_qwen2.5-7b_keep_activations.jsonl"),
    )
    assert result.equal, result.first_mismatch
    torch.use_deterministic_algorithms(False)
    runs = [{"method": "poros"}, {"method": "poros", "name": "poros_keep", "keep_activations": 28}]
    by = {r["method"]: r for r in bench_methods(config, runs, seq_len=512, lora_r=16, steps=4, warmup=2)}
    assert by["poros_keep"]["s_per_step"] < by["poros"]["s_per_step"]
    assert by["poros_keep"]["peak_vram_gb"] > by["poros"]["peak_vram_gb"]


def test_a_dropped_prepared_model_leaves_no_registration_behind() -> None:
    """Note: [unpin before free]: prepare, drop without unprepare, prepare again: no CUDA error later."""
    import gc

    for _ in range(3):
        grads = _qv_grads(0, steps=1)  # each call prepares a model and drops it
        del grads
        gc.collect()
    torch.cuda.synchronize()
    torch.zeros(1, device="cuda").add_(1)  # a later launch reports no stale error


def _slow_state_copies(monkeypatch: pytest.MonkeyPatch, cycles: int = 50_000_000) -> None:
    """Delay the optimizer state's copies in and out on their side streams (``torch.cuda._sleep``)."""
    from poros_lightning.engine.optim_state import HostOptimizerState

    prefetch, to_host = HostOptimizerState.prefetch, HostOptimizerState.to_host

    def delayed(direction: str, method):  # noqa: ANN001, ANN202
        def run(self: HostOptimizerState) -> object:
            stream = self._stream(torch.device("cuda", torch.cuda.current_device()), direction)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
            return method(self)

        return run

    monkeypatch.setattr(HostOptimizerState, "prefetch", delayed("in", prefetch))
    monkeypatch.setattr(HostOptimizerState, "to_host", delayed("out", to_host))


def _adamw_run(on_host: bool, fault: str | None = None, steps: int = 4) -> tuple[list[torch.Tensor], int]:
    """Params and moments after ``steps`` AdamW steps of a stack of linears, resident or with the state on host."""
    from poros_lightning.engine.optim_state import HostOptimizerState

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    host = HostOptimizerState(opt) if on_host else None
    if host is not None:
        host.fault = fault
    x = torch.randn(64, 2048, device="cuda")
    for _ in range(steps):
        if host is not None:
            host.arm()
        model(x).square().mean().backward()
        if host is not None:
            host.to_device()
        opt.step()
        if host is not None:
            host.to_host()
        opt.zero_grad(set_to_none=True)
    if host is not None:
        host.synchronize()
    torch.cuda.synchronize()
    out = [p.detach().cpu().clone() for p in model.parameters()]
    out += [v.detach().cpu().clone() for s in opt.state.values() for v in s.values() if v.dim() > 0]
    return out, host.prefetches if host is not None else 0


def test_optimizer_state_copies_are_ordered_under_slow_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note: [when the state moves]: copies in during the backward, out after the update, both slowed down:
    the parameters and moments equal a resident AdamW's; without the stream waits (control) they do not."""
    ref, _ = _adamw_run(False)
    _slow_state_copies(monkeypatch)
    got, prefetches = _adamw_run(True)
    assert prefetches == 3  # every step's backward but the first (no state yet) started the copy in
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    from poros_lightning.engine import optim_state

    # The control: memory the update reads before its copy in has landed holds NaN, not an older copy.
    monkeypatch.setattr(optim_state, "_empty_on", lambda v, d: torch.full_like(v, float("nan"), device=d))
    bad, _ = _adamw_run(True, fault="no_wait")
    assert not all(torch.equal(a, b) for a, b in zip(ref, bad, strict=True))


def test_profiled_step_accounts_for_every_phase() -> None:
    """The profiled step's phases split into busy and idle time that add up, and the streamed forward copies."""
    from poros_lightning.tools.bench.harness import bench_methods

    config = known_config("Qwen/Qwen2.5-1.5B")
    runs = [{"method": "resident_gc"}, {"method": "poros"}]
    by = {r["method"]: r for r in bench_methods(config, runs, seq_len=512, lora_r=16, steps=2, warmup=1, profile=True)}
    for row in by.values():
        for phase in ("forward", "backward", "update"):
            parts = sum(row[f"profile_{phase}_{k}"] for k in ("busy_s", "idle_copying_s", "idle_host_s"))
            assert parts == pytest.approx(row[f"profile_{phase}_s"], rel=1e-6)
            assert row[f"profile_{phase}_kernels"] > 0
    assert by["poros"]["profile_forward_side_h2d_gb"] > 0.5 * by["poros"]["host_store_gb"]
    assert by["resident_gc"]["profile_forward_side_h2d_gb"] == 0
    assert by["poros"]["loads_per_step"] == pytest.approx(by["poros"]["num_blocks"] * 2 - 4, abs=2)


def test_launch_probe_finds_a_bounded_queue() -> None:
    """The host can queue only so many launches ahead of a busy GPU (docs/benchmarks.md, "72B: where the time goes")."""
    from poros_lightning.tools.bench.launch_probe import probe

    row = probe(max_kernels=20000, sleep_s=2.0)
    assert row["queue_depth_kernels"] is not None and 100 < row["queue_depth_kernels"] < 20000
    assert 0 < row["launch_us_median"] < 1000


def test_default_strategy_plans_like_the_same_budget(tmp_path: Path) -> None:
    """``Trainer(strategy="poros")`` on the H200 capped at 16 GB makes the plan of ``vram_budget="16GB"``."""
    import json
    import logging

    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from poros_lightning import PorosStrategy
    from poros_lightning.lightning import planning

    cfg = dict(known_config("Qwen/Qwen2.5-7B"))
    gc.collect()  # what earlier tests left behind in this process would count against its cap
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    with torch.device("meta"):  # the plan reads the config and the adapter's rank, not the weights
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    peft_model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(16e9 / total)
    log = logging.getLogger("poros_lightning.test")
    rows = []
    try:
        for seq_len in (512, 2048):
            auto = planning.plan_for(PorosStrategy(seq_len=seq_len), peft_model, None, log)
            # 16 GB, less what this process still holds (nothing, when it runs alone: the budget is "16GB")
            fixed = planning.plan_for(
                PorosStrategy(vram_budget=int(16e9) - held, seq_len=seq_len), peft_model, None, log
            )
            rows.append({"seq_len": seq_len, "auto": auto.options(), "16GB": fixed.options(), "held_gb": held / 1e9,
                         "auto_budget_gb": auto.vram_budget / 1e9, "same": auto.options() == fixed.options()})  # fmt: skip
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    out = _artifacts(tmp_path, "benchmarks", "planner_default.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert all(r["same"] for r in rows), rows
