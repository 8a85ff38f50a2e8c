"""The memory planner: exact stored sizes, sane estimates, budgets (the smallest one too), size parsing."""

from __future__ import annotations

import math

import pytest

from poros_lightning.arch import known_config
from poros_lightning.errors import PorosConfigError, PorosOOMError
from poros_lightning.memory.budget import minimum_budget
from poros_lightning.memory.estimate import LOGITS_HEADROOM, budget_for, headroom_for
from poros_lightning.memory.planner import format_bytes, parse_bytes, plan_memory, quantized_weight_bytes

# Qwen2.5-7B shapes: hidden 3584, intermediate 18944, 28 layers, 28 query heads / 4 KV heads of dim 128.
QWEN25_7B = dict(
    model_type="qwen2",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
TINY = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
)


def _qwen25_7b_linears() -> list[tuple[int, int]]:
    h, i, kv = 3584, 18944, 4 * 128
    return [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]


def test_nf4_dq_bytes_follow_the_exact_formula():
    def nf4_dq(n: int) -> int:
        blocks = math.ceil(n / 64)
        return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256) + 4

    expected = 28 * sum(nf4_dq(a * b) for a, b in _qwen25_7b_linears())
    plan = plan_memory(QWEN25_7B)
    assert plan.nf4_base_bytes == expected
    assert plan.per_block_bytes == expected // 28
    params = 28 * sum(a * b for a, b in _qwen25_7b_linears())
    assert round(plan.nf4_base_bytes * 8 / params, 3) == 4.127  # 4 + 8/64 + 32/(64*256), plus the offsets


def test_plain_nf4_and_none_bytes():
    params = 28 * sum(a * b for a, b in _qwen25_7b_linears())
    nf4 = plan_memory(QWEN25_7B, quantization="nf4").nf4_base_bytes
    assert nf4 == 28 * sum(math.ceil(a * b / 2) + 4 * math.ceil(a * b / 64) for a, b in _qwen25_7b_linears())
    assert plan_memory(QWEN25_7B, quantization="none").nf4_base_bytes == 2 * params


def test_quantized_bytes_match_bitsandbytes():
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    for double_quant, name in ((True, "nf4-dq"), (False, "nf4")):
        layer = bnb.nn.Linear4bit(
            96, 40, bias=False, compute_dtype=torch.bfloat16, compress_statistics=double_quant, quant_type="nf4"
        ).to("cpu")
        weight, state = layer.weight, layer.weight.quant_state
        stored = weight.numel() * weight.element_size() + state.absmax.numel() * state.absmax.element_size()
        if state.nested:
            stored += state.state2.absmax.numel() * 4 + state.offset.numel() * 4
        assert stored == quantized_weight_bytes(96 * 40, name)


def test_lora_and_resident_bytes():
    plan = plan_memory(QWEN25_7B, lora_r=16)
    assert plan.lora_params == 28 * 16 * sum(a + b for a, b in _qwen25_7b_linears())
    assert plan.lora_bytes == 16 * plan.lora_params
    tied = plan_memory(dict(QWEN25_7B, tie_word_embeddings=True))
    assert plan.resident_bytes - tied.resident_bytes == 2 * 152064 * 3584
    assert plan.params_total == 7_615_616_512


def test_estimates_grow_with_seq_len():
    plans = [plan_memory(QWEN25_7B, seq_len=t) for t in (128, 512, 2048, 8192)]
    for field in ("activation_streamed_bytes", "activation_resident_bytes", "streamed_vram_min", "resident_vram"):
        values = [getattr(p, field) for p in plans]
        assert values == sorted(values) and len(set(values)) == len(values), field
    assert all(p.nf4_base_bytes == plans[0].nf4_base_bytes for p in plans)


def test_streaming_needs_less_than_resident():
    plan = plan_memory(known_config("Qwen/Qwen2.5-32B-Instruct"))
    assert plan.streamed_vram_min < plan.resident_vram_gc < plan.resident_vram
    assert plan.activation_resident_gc_bytes <= plan.activation_resident_bytes
    assert plan.host_ram_streamed > plan.nf4_base_bytes
    assert plan.slots == 2 and plan.num_blocks == 64


def test_block_size_and_prefetch():
    one = plan_memory(QWEN25_7B, block_size=1)
    four = plan_memory(QWEN25_7B, block_size=4, prefetch=2)
    assert four.per_block_bytes == 4 * one.per_block_bytes
    assert four.slots == 3 and four.num_blocks == 7
    assert four.streamed_vram_min > one.streamed_vram_min
    uneven = plan_memory(QWEN25_7B, block_size=3)
    assert uneven.num_blocks == 10 and uneven.per_block_bytes == 3 * one.per_block_bytes
    with pytest.raises(PorosConfigError, match="exceeds the model's 28 decoder layers"):
        plan_memory(QWEN25_7B, block_size=29)
    with pytest.raises(PorosConfigError, match="seq_len"):
        plan_memory(QWEN25_7B, seq_len=0)
    with pytest.raises(PorosConfigError, match="quantization"):
        plan_memory(QWEN25_7B, quantization="int8")


def test_vram_budget():
    plan = plan_memory(QWEN25_7B, vram_budget="1GB")
    assert plan.fits is False and plan.resident_fits is False
    need, logits = plan.streamed_vram_min, plan.logits_bytes
    assert plan.min_budget == budget_for(need, logits) > need > 10**9  # headroom
    # At seq 512 the logits' headroom (0.8 x 10 x tokens x vocabulary) is larger than 10% of the budget.
    assert plan.min_budget == need + int(LOGITS_HEADROOM * logits) > budget_for(need)
    assert headroom_for(plan.min_budget, logits) == plan.min_budget - need
    assert headroom_for(10**12, logits) == 10**11  # 10% where that is larger
    # And twice the largest dequantized weight, where that is larger: what a backward's matmul holds beyond the estimate.
    assert plan.dequant_bytes == 2 * 18944 * 3584  # down_proj in bf16
    assert (
        headroom_for(10**9, 0, plan.dequant_bytes)
        == 2 * plan.dequant_bytes
        == budget_for(10**9, 0, plan.dequant_bytes) - 10**9
    )
    assert plan.max_block_size is None
    roomy = plan_memory(QWEN25_7B, vram_budget="80GB")
    assert roomy.fits is True and roomy.resident_fits is True and roomy.max_block_size == 28
    just = plan_memory(QWEN25_7B, vram_budget=plan.min_budget)
    assert just.fits is True
    assert plan_memory(QWEN25_7B, vram_budget=plan.min_budget - 1).fits is False
    chunked = plan_memory(QWEN25_7B, vram_budget="1GB", loss_chunk_tokens=64)
    assert chunked.logits_bytes < logits and chunked.min_budget < plan.min_budget  # chunks need less headroom
    assert plan_memory(QWEN25_7B).fits is None


def test_every_known_checkpoint_plans():
    from poros_lightning.arch import known_ids

    for hub_id in known_ids():
        plan = plan_memory(known_config(hub_id), vram_budget="24GB")
        assert 0 < plan.per_block_bytes < plan.nf4_base_bytes < plan.params_total, hub_id
        assert plan.streamed_vram_min == (
            plan.resident_bytes
            + plan.lora_bytes
            + plan.slots * plan.per_block_bytes
            + plan.activation_streamed_bytes
            + plan.workspace_bytes
        )
        assert plan.resident_vram == (
            plan.nf4_base_bytes
            + plan.resident_bytes
            + plan.lora_bytes
            + plan.activation_resident_bytes
            + plan.workspace_bytes
        )


def test_hybrid_and_multimodal_families_plan():
    qwen3_5 = dict(
        model_type="qwen3_5_text", hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=300, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4,
    )  # fmt: skip
    plan = plan_memory(qwen3_5, lora_r=2)
    # linear-attention layers (3 of 4) adapt in_proj_qkv/z/b/a + out_proj; the full-attention layer q/k/v/o
    linear_attn = (64 + 64) + (64 + 32) + (64 + 4) * 2 + (32 + 64)  # conv_dim = 2 * 16 + 32
    full_attn = (64 + 128) + (64 + 32) * 2 + (64 + 64)
    mlp = 3 * (64 + 96)
    assert plan.lora_params == 2 * (3 * (linear_attn + mlp) + full_attn + mlp)
    gemma3 = plan_memory(known_config("google/gemma-3-4b-it"))
    text_only = plan_memory(dict(known_config("google/gemma-3-4b-it")["text_config"], tie_word_embeddings=True))
    assert gemma3.nf4_base_bytes == text_only.nf4_base_bytes
    assert gemma3.resident_bytes > text_only.resident_bytes  # the vision tower stays resident


def test_parse_bytes():
    assert parse_bytes("8GB") == 8 * 10**9
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("512 mib") == 512 * 2**20
    assert parse_bytes("1.5G") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    assert parse_bytes(123) == 123
    for bad in ("", "8XB", "GB", "-1GB", -5, True):
        with pytest.raises(PorosConfigError, match="HINT"):
            parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(7_240_000_000) == "7.24 GB"
    assert format_bytes(999) == "999 B"


def test_plan_engine_fills_the_budget_and_names_the_minimum():
    from poros_lightning.arch.known import known_config
    from poros_lightning.errors import PorosOOMError
    from poros_lightning.memory.planner import plan_engine

    cfg = known_config("Qwen/Qwen2.5-7B")
    # At 55 GB/s a 7B block (120 MB) copies within a layer's forward: spare memory keeps activations first
    # (the last layers), then blocks resident.
    small, large = plan_engine(cfg, "4.3GB", link_gbps=55), plan_engine(cfg, "16GB", link_gbps=55)
    assert small.embeddings_on_host and not large.embeddings_on_host
    assert 0 < small.keep_activations < large.keep_activations == 28 and small.resident_blocks == 0
    assert 0 < large.resident_blocks <= 26
    assert any("kept activations first" in line for line in small.explanation)
    assert plan_engine(cfg, "16GB", keep_activations=False).resident_blocks == 26
    assert small.vram_estimate <= 0.9 * small.vram_budget
    with pytest.raises(PorosOOMError, match="vram_budget >= ") as err:
        plan_engine(known_config("Qwen/Qwen2.5-72B"), "4GB")
    assert isinstance(err.value, MemoryError)


def test_refusal_prices_the_chunked_loss_it_suggests():
    """A refusal with the full logits of many tokens names the chunked loss and the budget that needs."""
    from poros_lightning.memory.planner import CHUNK_HINT_TOKENS, plan_engine

    cfg = known_config("Qwen/Qwen2.5-7B")
    with pytest.raises(PorosOOMError) as err:  # 4 x 2048 tokens: 12.46 GB of logits
        plan_engine(cfg, "16GB", seq_len=2048, batch_size=4)
    chunked = minimum_budget(cfg, seq_len=2048, batch_size=4, loss_chunk_tokens=CHUNK_HINT_TOKENS)
    assert err.value.hint.endswith(
        f"(LoRALightningModule(loss_chunk_tokens=512), which needs vram_budget >= {format_bytes(chunked)})."
    )
    with pytest.raises(PorosOOMError) as err:  # chunked already: nothing more to suggest
        plan_engine(cfg, "4GB", seq_len=2048, batch_size=4, loss_chunk_tokens=1024)
    assert "loss_chunk_tokens" not in err.value.hint
    with pytest.raises(PorosOOMError) as err:  # 512 tokens: chunks of 512 would change nothing
        plan_engine(known_config("Qwen/Qwen2.5-72B"), "4GB")
    assert "loss_chunk_tokens" not in err.value.hint


def test_link_bound_blocks_spend_spare_memory_on_resident_blocks_first():
    """Note: [link-bound layers]: a block that copies slower than a layer's forward makes resident blocks pay."""
    from poros_lightning.arch.known import known_config
    from poros_lightning.memory.planner import DEFAULT_LINK_GBPS, LAYER_FORWARD_S, plan_engine, plan_memory

    cfg = known_config("Qwen/Qwen2.5-72B")
    block = plan_memory(cfg, seq_len=512).per_block_bytes
    assert block / 55e9 > LAYER_FORWARD_S and block / (DEFAULT_LINK_GBPS * 1e9) > LAYER_FORWARD_S
    plan = plan_engine(cfg, "24GB", link_gbps=55)
    # 24 GB less 10% headroom holds 21 more blocks of 453 MB, and what is left one kept layer (319 MB)
    assert (plan.resident_blocks, plan.keep_activations) == (21, 1)
    assert any("resident blocks first" in line for line in plan.explanation)
    assert plan.vram_estimate <= 0.9 * plan.vram_budget
    # kept activations are what spare memory buys once every block is resident
    roomy = plan_engine(cfg, "60GB", link_gbps=55)
    assert roomy.resident_blocks == 78 and roomy.keep_activations > 0
    # the 7B block is link-bound on a PCIe 3.0 link (12 GB/s: 10 ms a copy), not on PCIe 4.0 (the default: a
    # 4.8 ms copy leaves 0.8 ms unhidden, for 120 MB; a kept layer saves 4 ms for 170 MB) nor at 55 GB/s
    seven = known_config("Qwen/Qwen2.5-7B")
    assert plan_engine(seven, "4.3GB", link_gbps=12).resident_blocks > 0
    assert plan_engine(seven, "4.3GB").resident_blocks == plan_engine(seven, "4.3GB", link_gbps=55).resident_blocks == 0


def test_resident_blocks_pay_per_byte_of_what_they_save():
    """A block's copies save only what the forward leaves exposed; a kept layer saves a whole forward."""
    from poros_lightning.memory.planner import resident_pays

    mb = 10**6
    # Qwen2.5-72B, seq 512, 55 GB/s: 2 x 4.2 ms exposed for 453 MB against 4 ms for 319 MB
    assert resident_pays(8.2e-3, 4e-3, 453 * mb, 319 * mb)
    # Qwen2.5-32B: 2 x 0.6 ms for 252 MB against 4 ms for 246 MB; hidden copies save nothing
    assert not resident_pays(4.6e-3, 4e-3, 252 * mb, 246 * mb)
    assert not resident_pays(4.6e-3, 5.4e-3, 252 * mb, 246 * mb)
    # Qwen2.5-32B on the H100, timed: 2.6 ms of kernels makes 2 x 2 ms exposed look better, but each kept layer
    # given up cost the step 5.4-7.3 ms, and the recomputes, bound by the host, were timed at 4.4-7.0 ms: 6.5 here
    assert resident_pays(4.6e-3, 2.6e-3, 252 * mb, 246 * mb)
    assert not resident_pays(4.6e-3, 2.6e-3, 252 * mb, 246 * mb, recompute_s=6.5e-3)
    # ... and on a PCIe 4.0 link (10.1 ms a copy) resident blocks pay again
    assert resident_pays(10.1e-3, 4e-3, 252 * mb, 246 * mb)
    assert resident_pays(1.0, 0.1, 252 * mb, 0) and not resident_pays(1.0, 0.1, 0, 246 * mb)
    # a block of two layers: its 8 ms forward is two layers' 4 ms, so a kept layer saves 4 ms, not 8
    assert not resident_pays(14e-3, 8e-3, 504 * mb, 246 * mb) and resident_pays(14e-3, 8e-3, 504 * mb, 246 * mb, 2)


def test_a_layers_forward_grows_with_its_tokens():
    """The layer forward the planner compares a block's copy with: the launch floor, or the layer's matmuls."""
    from poros_lightning.arch.known import known_config
    from poros_lightning.memory.planner import LAYER_FLOPS, LAYER_FORWARD_S, layer_forward_s, plan_engine, plan_memory

    cfg = known_config("Qwen/Qwen2.5-32B")
    short, long = plan_memory(cfg, seq_len=512), plan_memory(cfg, seq_len=2048)
    assert layer_forward_s(short) == LAYER_FORWARD_S  # 0.5 TFLOP per layer: the host's launches bound it
    # 2 x 0.49 B weights x 2048 tokens: about 7.1 ms, measured 6.7 ms on the H100 (planner_sweep.jsonl)
    assert long.layer_forward_flops == 2 * 2048 * (5120 * (5120 + 1024 + 1024 + 5120) + 3 * 5120 * 27648)
    assert 6.5e-3 < layer_forward_s(long) == long.layer_forward_flops / LAYER_FLOPS < 7.2e-3
    # block-major micro-batches pass through a block in one forward: all their tokens count
    assert plan_memory(cfg, seq_len=512, micro_batches=4).layer_forward_flops == long.layer_forward_flops
    # a 252 MB block copies in 4.6 ms at 55 GB/s: about a 4 ms forward at seq 512, so kept layers save more per
    # byte (resident_pays); at 25 GB/s (10.1 ms a copy) resident blocks do
    assert (plan_engine(cfg, "16GB", link_gbps=55).resident_blocks, plan_engine(cfg, "16GB").keep_activations) == (0, 0)
    plan = plan_engine(cfg, "16GB", link_gbps=55, seq_len=2048)
    assert (plan.resident_blocks, plan.keep_activations) == (2, 1)  # kept first; less than a layer left: blocks
    assert any("forward of about 7 ms: per byte, kept activations" in line for line in plan.explanation)


def test_plan_engine_turns_on_minimum_memory_options_by_copies_per_byte_saved():
    from poros_lightning.arch.known import known_config
    from poros_lightning.memory.planner import plan_engine

    cfg = known_config("Qwen/Qwen2.5-72B")
    # budgets of 12, 8 and 7 GB usable: the plan leaves 10% of each budget to the allocator (more than the
    # 0.62 GB that 0.8 x the logits of 512 tokens asks for at these budgets: Note: [headroom])
    roomy, medium, tight = plan_engine(cfg, "13.4GB"), plan_engine(cfg, "8.9GB"), plan_engine(cfg, "7.8GB")
    assert not (roomy.embeddings_on_host or roomy.head_on_host or roomy.optimizer_on_host)
    assert medium.embeddings_on_host and medium.optimizer_on_host and not medium.head_on_host  # moments first
    assert tight.embeddings_on_host and tight.head_on_host and tight.optimizer_on_host
    assert not plan_engine(cfg, "8.8GB", head_frozen=False).head_on_host  # a trained head stays
    with pytest.raises(PorosOOMError, match="vram_budget >= 8.70 GB"):
        plan_engine(cfg, "7.8GB", head_frozen=False)
    assert tight.engine_kwargs()["head_on_host"] and "optimizer_on_host" not in tight.engine_kwargs()
    assert any("LM head in host memory" in line for line in tight.explanation)
    middle = plan_engine(known_config("Qwen/Qwen2.5-32B"), "6.67GB")  # embeddings alone suffice (6 GB usable)
    assert middle.embeddings_on_host and not middle.head_on_host and not middle.optimizer_on_host
    # a tied head stays: only the moments move (1.33 GB usable: the logits' 0.62 GB of headroom is over 10%)
    tied = plan_engine(known_config("Qwen/Qwen2.5-0.5B"), "1.95GB")
    assert not tied.embeddings_on_host and not tied.head_on_host and tied.optimizer_on_host


def test_a_running_layer_holds_its_widest_adapted_projections_fp32_lora_output():
    """The 7B minimum plan at seq 4096 (4 x 4 rows) ran out of memory in PEFT's fp32 ``lora_B(...) * scaling`` of the
    MLP's 18944-wide projections (docs/benchmarks/recipes.jsonl): the layer that runs holds one such output."""
    cfg = known_config("Qwen/Qwen2.5-7B")
    tokens = 4 * 4096
    full = plan_memory(cfg, seq_len=4096, batch_size=4)
    attention = plan_memory(cfg, seq_len=4096, batch_size=4, lora_targets=["q_proj", "v_proj"])
    bare = plan_memory(cfg, seq_len=4096, batch_size=4, lora_targets=[])
    assert full.recompute_layer_bytes - full.activation_layer_bytes == tokens * 4 * 18944  # gate/up/down's widest
    assert attention.recompute_layer_bytes - attention.activation_layer_bytes == tokens * 4 * 3584  # q_proj's out
    assert bare.recompute_layer_bytes == bare.activation_layer_bytes  # no adapter: no fp32 LoRA output


def test_a_chunked_loss_budgets_one_chunk_of_logits():
    """loss_chunk_tokens: the logits term is 10 bytes x min(tokens, chunk) x vocabulary, in every mode."""
    full = plan_memory(QWEN25_7B, seq_len=2048)
    chunked = plan_memory(QWEN25_7B, seq_len=2048, loss_chunk_tokens=256)
    assert full.logits_bytes == 10 * 2048 * 152064 and chunked.logits_bytes == 10 * 256 * 152064
    saved = full.logits_bytes - chunked.logits_bytes
    assert full.streamed_vram_min - chunked.streamed_vram_min == saved
    assert full.resident_vram_gc - chunked.resident_vram_gc == saved
    assert chunked.loss_chunk_tokens == 256 and full.loss_chunk_tokens is None
    # a chunk longer than the batch is the whole batch
    assert plan_memory(QWEN25_7B, seq_len=512, loss_chunk_tokens=4096).logits_bytes == 10 * 512 * 152064
    assert plan_memory(QWEN25_7B, seq_len=512, batch_size=2, loss_chunk_tokens=1024).logits_bytes == 10 * 1024 * 152064
    for bad in (0, -1, True, 2.5):
        with pytest.raises(PorosConfigError, match="loss_chunk_tokens"):
            plan_memory(QWEN25_7B, loss_chunk_tokens=bad)


def test_plan_engine_with_a_chunked_loss():
    """Chunks shrink the minimum plan; a host head then saves only what is away from the chunks, with one copy."""
    from poros_lightning.memory.planner import plan_engine

    cfg = known_config("Qwen/Qwen2.5-7B")
    with pytest.raises(PorosOOMError):
        plan_engine(cfg, "3GB", seq_len=2048)
    plan = plan_engine(cfg, "3GB", seq_len=2048, loss_chunk_tokens=256)
    assert plan.head_on_host and plan.head_copies == 1
    assert "LM head and loss in chunks of 256 tokens" in plan.explanation[0]
    memory = plan_memory(cfg, seq_len=2048, loss_chunk_tokens=256)
    hidden_state = 2048 * 3584 * 2  # the head's input and its gradient stay beside the weight
    away = memory.activation_streamed_bytes - 28 * hidden_state - memory.logits_bytes - 2 * hidden_state
    table = 152064 * 3584 * 2
    assert any(f"saves {format_bytes(min(table, away))}" in line for line in plan.explanation)
    assert plan.vram_estimate <= 0.9 * plan.vram_budget
    # Beside the last layers' forwards the weight would take back what it saves: 3 GB cannot hold both.
    assert not plan.head_prefetch and plan.engine_kwargs()["head_prefetch"] is False
    assert any("the head's copy waits for the head" in line for line in plan.explanation)


def test_a_host_head_is_copied_during_the_forwards_only_where_both_fit():
    """With a chunked loss the head's copy spreads over the last layers' forwards (hidden) where the budget holds
    the weight beside them, and waits for the head at the smallest budgets; kept layers never take that room."""
    from poros_lightning.memory.budget import minimum_budget
    from poros_lightning.memory.planner import plan_engine

    cfg = known_config("Qwen/Qwen2.5-72B")
    kw = {"seq_len": 512, "micro_batches": 16, "loss_chunk_tokens": 64}
    smallest = plan_engine(cfg, minimum_budget(cfg, **kw), **kw)
    assert smallest.head_on_host and smallest.head_copies == 1 and not smallest.head_prefetch
    roomy = plan_engine(cfg, "16GB", **kw)
    assert roomy.head_on_host and roomy.head_prefetch
    assert not any(line.startswith("the head's copy waits for the head") for line in roomy.explanation)
    # The copy spread over the last layers' forwards is counted beside them; resident blocks fit around it.
    assert roomy.vram_estimate <= 16e9 - 1.6e9 and roomy.resident_blocks > 0


@pytest.mark.parametrize("seq_len", [512, 2048, 4096])
@pytest.mark.parametrize("hub_id", ["Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-0.5B"])
def test_minimum_budget_is_the_smallest_budget_plan_engine_accepts(hub_id, seq_len):
    from poros_lightning.memory.budget import minimum_budget
    from poros_lightning.memory.planner import plan_engine

    cfg = known_config(hub_id)
    smallest = minimum_budget(cfg, seq_len=seq_len)
    plan = plan_engine(cfg, smallest, seq_len=seq_len)
    assert plan.vram_estimate <= smallest
    with pytest.raises(PorosOOMError) as err:
        plan_engine(cfg, smallest - 1, seq_len=seq_len)
    # Every host-side option the model allows is on: the figure the refusal names, as a number.
    assert err.value.needed_bytes == smallest
    assert plan.optimizer_on_host and plan.inputs_on_host
    tied = bool(cfg.get("tie_word_embeddings"))
    assert plan.embeddings_on_host is plan.head_on_host is not tied
    assert plan.vram_estimate < plan_memory(cfg, seq_len=seq_len).streamed_vram_min
    headroom = headroom_for(smallest, plan_memory(cfg, seq_len=seq_len).logits_bytes)  # Note: [headroom]
    assert plan.vram_estimate <= smallest - headroom


def test_minimum_budget_below_the_all_options_need():
    """With a long adapter beside short activations, moving the optimizer state out costs more than it saves
    (the update then holds the adapter, its gradient, the moments and a temporary): the smallest budget that
    fits stops before that step, below the figure the refusal names."""
    from poros_lightning.memory.budget import minimum_budget
    from poros_lightning.memory.planner import plan_engine

    smallest = minimum_budget(TINY, seq_len=8, lora_r=64)
    with pytest.raises(PorosOOMError) as err:
        plan_engine(TINY, 1, seq_len=8, lora_r=64)
    assert smallest < err.value.needed_bytes
    plan = plan_engine(TINY, smallest, seq_len=8, lora_r=64)
    assert plan.embeddings_on_host and not plan.optimizer_on_host
    with pytest.raises(PorosOOMError):
        plan_engine(TINY, smallest - 1, seq_len=8, lora_r=64)


def test_block_major_micro_batches_keep_every_input_and_recompute_one_micro_batch():
    """micro_batches=k: the layers' inputs, the boundary gradients and the unchunked logits of all k micro-batches,
    a kept layer's activations of all k, a recompute of one (Note: [one checkpoint per micro-batch])."""
    cfg = known_config("Qwen/Qwen2.5-7B")
    one = plan_memory(cfg, seq_len=512, batch_size=1)
    whole = plan_memory(cfg, seq_len=512, batch_size=16)
    split = plan_memory(cfg, seq_len=512, batch_size=1, micro_batches=16)
    assert split.recompute_layer_bytes == one.recompute_layer_bytes
    assert split.activation_layer_bytes == whole.activation_layer_bytes == 16 * one.activation_layer_bytes
    assert split.logits_bytes == whole.logits_bytes
    # one batch of 16 rows recomputes all of them at once: block-major needs less, but a layer's LoRA gradients
    # of all 16 wait for their ordered sum (Note: [a parameter's sum when its last gradient arrives]), fp32
    layer_lora = 16 * (2 * 3584 + 2 * (3584 + 512) + 2 * 3584 + 2 * (3584 + 18944) + (18944 + 3584))
    assert (
        split.activation_streamed_bytes
        == whole.activation_streamed_bytes
        - (whole.recompute_layer_bytes - one.recompute_layer_bytes)
        + 4 * 16 * layer_lora
    )
    assert split.resident_vram_gc == one.resident_vram_gc  # the resident reference accumulates one at a time
    with pytest.raises(PorosConfigError, match="micro_batches"):
        plan_memory(cfg, micro_batches=0)
    # the smallest budgets for an effective batch of 16 x 512, the head and the loss in chunks of 512 tokens
    smallest = {
        m: minimum_budget(known_config(m), seq_len=512, micro_batches=16, loss_chunk_tokens=512)
        for m in ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-72B")
    }
    assert format_bytes(smallest["Qwen/Qwen2.5-7B"]) == "3.24 GB"  # 2.62 GB usable: 0.62 GB of logits headroom
    assert format_bytes(smallest["Qwen/Qwen2.5-72B"]) == "7.17 GB"


def test_the_backward_tail_counts_what_a_layer_backward_holds():
    """With the moments in host memory, the plan also prices the backward's last quarter: sample-major the moments
    come in there, beside the adapter, its gradient, one layer's recompute and backward (the dequantized weight,
    the boundary gradients) and the inputs of the layers still to recompute; block-major they come in after the
    backward (Note: [when the state moves]), whose last quarter holds every micro-batch's gradients."""
    from poros_lightning.memory.planner import plan_engine

    cfg = known_config("Qwen/Qwen2.5-72B")
    kw = dict(seq_len=4096, batch_size=4, micro_batches=4, loss_chunk_tokens=1024)
    plan = plan_memory(cfg, block_size=1, prefetch=1, **kw)
    assert plan.boundary_bytes == 16 * 4096 * 8192 * 2
    assert plan.backward_extra_bytes == plan.dequant_bytes + 2 * plan.boundary_bytes + 4 * 4 * 16 * (
        2 * 8192 + 2 * (8192 + 1024) + 2 * 8192 + 3 * (8192 + 29568)
    )
    smallest = minimum_budget(cfg, **kw)
    tight = plan_engine(cfg, smallest, **kw)
    assert tight.optimizer_on_host and tight.inputs_on_host
    moments = plan.lora_params * 8
    tail = (
        plan.slots * plan.per_block_bytes + plan.lora_bytes - moments + plan.recompute_layer_bytes
        + plan.backward_extra_bytes + 2 * plan.boundary_bytes
    )  # fmt: skip
    table = 152064 * 8192 * 2  # embeddings and head, both in host memory: the tail is this plan's peak
    assert tight.embeddings_on_host and tight.head_on_host
    assert tight.vram_estimate == tail + plan.resident_bytes + plan.workspace_bytes - 2 * table
    assert tight.vram_estimate <= smallest - headroom_for(smallest, plan.logits_bytes, plan.dequant_bytes)


def test_the_estimate_counts_torchs_cublas_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note: [cuBLAS workspaces]: two per step (the forward's thread and the autograd engine's), each of
    ``CUBLAS_WORKSPACE_CONFIG``'s size, 32 MiB where it is unset."""
    from poros_lightning.memory.estimate import BLAS_WORKSPACE_BYTES, blas_workspace_bytes

    assert blas_workspace_bytes({}) == 2 * BLAS_WORKSPACE_BYTES == 2 * 32 * 2**20
    assert blas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 2 * 4096 * 1024 * 8  # deterministic runs
    assert blas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 2 * 16 * 1024 * 8
    assert blas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)
    assert blas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": "plenty"}) == 2 * BLAS_WORKSPACE_BYTES  # torch's default
    cfg = known_config("Qwen/Qwen2.5-7B")
    default = plan_memory(cfg)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    small = plan_memory(cfg)
    assert small.workspace_bytes == 2 * 16 * 1024 * 8
    shrunk = default.workspace_bytes - small.workspace_bytes
    assert default.streamed_vram_min - small.streamed_vram_min == shrunk
    assert default.resident_vram_gc - small.resident_vram_gc == shrunk


def test_the_minimum_plans_measured_on_the_h200_are_not_under_predicted() -> None:
    """The block-major minimum plans of 2026-12-07 (16 x 512 tokens, loss in chunks of 64; H200,
    docs/benchmarks/recipes.jsonl): today's estimate of the same plan is 1.0-1.25 times each allocated peak. Without
    the cuBLAS workspaces the 7B estimate was 0.976 times it."""
    import json
    from pathlib import Path

    from poros_lightning.memory.planner import plan_engine

    path = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "recipes.jsonl"
    peaks: dict[str, float] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if (
            str(row.get("run_id", "")) >= "2026-12-07T05:41"
            and row.get("base_method") == "poros"
            and row["vram_budget"]
            and row["micro_batches"] == 16
        ):
            assert row["loss_chunk_tokens"] == 64 and not row["oom"]
            peaks[row["scale"]] = max(peaks.get(row["scale"], 0.0), row["peak_vram_gb"])
    assert set(peaks) == {"7B", "32B", "72B"}
    for scale, peak in peaks.items():
        cfg = known_config(f"Qwen/Qwen2.5-{scale}")
        kw = dict(seq_len=512, micro_batches=16, loss_chunk_tokens=64)
        plan = plan_engine(cfg, minimum_budget(cfg, **kw), **kw)
        assert plan.inputs_on_host and plan.head_on_host and plan.keep_activations == plan.resident_blocks == 0
        assert 1.0 <= plan.vram_estimate / (peak * 1e9) <= 1.25, scale


@pytest.mark.parametrize("seq_len", [512, 2048, 4096])
@pytest.mark.parametrize("hub_id", ["Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-72B"])
def test_a_bigger_budget_never_plans_more_work(hub_id: str, seq_len: int) -> None:
    """From the smallest budget the planner accepts to 80 GB in steps of 0.25 GB: a host-side option, once off,
    stays off; the head's copies per step never grow (but where the layers' inputs come back to the device) and
    its prefetch, once on, stays on; and between budgets
    with the same options, the time the planner's own model says kept layers and resident blocks save
    (a kept layer: one layer forward; a resident block: its two copies less what a forward hides,
    ``resident_pays``'s terms) never shrinks. The plan trades one for the other only where that saves more."""
    from poros_lightning.memory.planner import DEFAULT_LINK_GBPS, layer_forward_s, plan_engine

    cfg = known_config(hub_id)
    shape = plan_memory(cfg, seq_len=seq_len, block_size=1, prefetch=1)
    copy_s, forward_s = shape.per_block_bytes / (DEFAULT_LINK_GBPS * 1e9), layer_forward_s(shape)
    options = ("embeddings_on_host", "optimizer_on_host", "head_on_host", "inputs_on_host")
    before = None
    for budget in range(minimum_budget(cfg, seq_len=seq_len), int(80e9), int(0.25e9)):
        plan = plan_engine(cfg, budget, seq_len=seq_len)
        on = tuple(getattr(plan, name) for name in options)
        saved = plan.keep_activations * forward_s + plan.resident_blocks * 2 * max(copy_s - forward_s, 0.0)
        if before is not None:
            was_on, was_saved, was = before
            assert all(was or not now for was, now in zip(was_on, on, strict=True)), (budget, was_on, on)
            # The one exception the planner documents: the layers' inputs come back to the device before the head
            # keeps its forward's copy for its backward (their copies cost the step more than the head's one).
            inputs_back = was.inputs_on_host and not plan.inputs_on_host
            assert plan.head_copies <= was.head_copies or not plan.head_on_host or inputs_back, budget
            assert plan.head_prefetch or not was.head_prefetch, budget
            if on == was_on and plan.head_copies == was.head_copies:
                assert saved >= was_saved - 1e-12, (budget, was, plan)
        before = (on, saved, plan)
