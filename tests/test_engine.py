"""The engine on its own (no Lightning): streamed training is torch.equal to resident training."""

from __future__ import annotations

import pytest
import torch
from conftest import build_peft_model, differences, tiny_config, train_loop

from poros_lightning import prepare, unprepare
from poros_lightning.api import engine_of
from poros_lightning.engine.slots import resident_positions


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_loop(build_peft_model(lora_dropout=0.1))


@pytest.mark.parametrize("block_size", [1, 2])
def test_streamed_equals_resident(reference: dict, block_size: int) -> None:
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", block_size=block_size)
    got = train_loop(model)
    assert differences(reference, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}


def test_more_blocks_than_slots_reuses_slots(reference: dict) -> None:
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", block_size=1)
    engine = engine_of(model)
    assert engine.num_blocks == 4 and engine.options.num_slots == 2
    got = train_loop(model)
    assert differences(reference, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}
    # first step: 4 forward loads + 2 backward reloads; later steps 4 each (the turns reuse slots)
    assert engine.ring.loads == 6 + 4 + 4


def test_wrong_slot_negative_control(reference: dict) -> None:
    """Reloading a block into another block's slot breaks the gradients: the parity test can fail."""
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", block_size=1)
    engine_of(model).ring.fault = "wrong_slot"
    got = train_loop(model)
    diff = differences(reference, got)
    assert torch.equal(reference["loss"][0], got["loss"][0])  # the forward is still exact
    assert diff["grads"] > 0 and diff["adapter"] > 0


def test_gradient_accumulation() -> None:
    ref = train_loop(build_peft_model(lora_dropout=0.1), steps=2, accumulate=2)
    got = train_loop(prepare(build_peft_model(lora_dropout=0.1), device="cpu"), steps=2, accumulate=2)
    assert differences(ref, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}


def test_unprepare_restores_a_resident_model() -> None:
    model = build_peft_model(lora_dropout=0.0)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    prepare(model, device="cpu", block_size=1)
    with torch.no_grad():
        streamed = model(input_ids=ids).logits
    unprepare(model)
    assert engine_of(model) is None
    assert all("forward" not in layer.__dict__ for layer in model.get_base_model().model.layers), (
        "layer forwards must be restored"
    )
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, streamed) and torch.equal(before, after)


def test_unquantized_base_streams() -> None:
    cfg = tiny_config()
    ref = train_loop(build_peft_model(cfg, quantization="none"))
    got = train_loop(prepare(build_peft_model(cfg, quantization="none"), device="cpu"))
    assert differences(ref, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}


def test_resident_blocks_and_host_embeddings(reference: dict) -> None:
    """Minimum-memory and fewer-copies options keep every surface exact."""
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", resident_blocks=1, embeddings_on_host=True)
    engine = engine_of(model)
    assert engine.ring.resident == 1 and len(engine.ring.slots) == 3
    got = train_loop(model)
    assert differences(reference, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}
    # block 2 (the middle of the model) is copied once; the three streamed blocks share a ring of two slots
    assert engine.ring.resident_at == [2]
    assert engine.ring.loads == (1 + 3 + 1) + 2 + 2


@pytest.mark.parametrize(("resident", "keep"), [(2, 0), (2, 1), (3, 2)])
def test_spread_resident_blocks_are_exact(reference: dict, resident: int, keep: int) -> None:
    """Resident blocks between streamed ones (and kept activations on either kind) change no bit."""
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", resident_blocks=resident, keep_activations=keep)
    assert engine_of(model).ring.resident_at == resident_positions(4, resident)
    assert differences(reference, train_loop(model)) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}


def test_resident_blocks_are_spread_and_the_ring_fills_behind_them() -> None:
    """Resident blocks sit in the middle of equal stretches; while one computes, the ring copies ahead."""
    assert resident_positions(4, 1) == [2] and resident_positions(4, 4) == [0, 1, 2, 3]
    assert resident_positions(5, 0) == [] and resident_positions(80, 22)[:4] == [1, 5, 9, 12]
    for blocks, resident in [(80, 22), (64, 63), (7, 3)]:
        at = resident_positions(blocks, resident)
        assert len(set(at)) == resident and at == sorted(at) and 0 <= at[0] and at[-1] < blocks
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", resident_blocks=1)
    ring = engine_of(model).ring
    issued: list[tuple[int, int]] = []  # (block being made computable, block copied)
    ensure, copy = ring.ensure, ring._copy
    current = [-1]

    def traced_ensure(block: int, backward: bool = False) -> None:
        current[0] = block
        ensure(block, backward)

    def traced_copy(block: int, slot: int) -> None:
        issued.append((current[0], block))
        copy(block, slot)

    ring.ensure, ring._copy = traced_ensure, traced_copy
    train_loop(model, steps=2)
    # First step: blocks 0, 1, 3 and the resident 2 come in for the forward; the backward copies block 0
    # while resident block 2 computes (two streamed blocks ahead: every ring slot is free then).
    assert issued[:5] == [(0, 0), (0, 1), (1, 3), (2, 2), (2, 0)]
    # Later steps: the turns reuse the ring; one copy each way.
    assert issued[5:] == [(1, 3), (2, 0)]


def test_head_on_host_is_exact_and_copies_the_head_per_use(reference: dict) -> None:
    """The head's weight waits in host memory; its forward and its backward each copy it in."""
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", embeddings_on_host=True, head_on_host=True)
    engine = engine_of(model)
    head = model.get_base_model().lm_head
    assert engine.host_head is not None and head.weight.data_ptr() == engine.host_head.host.data_ptr()
    got = train_loop(model)
    assert differences(reference, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}
    assert engine.host_head.loads == 2 * 3  # train_loop runs 3 steps
    assert head.weight.data_ptr() == engine.host_head.host.data_ptr()  # back on the host between uses


def test_head_on_host_backward_reads_a_fresh_copy() -> None:
    """Negative control: the backward uses the bytes copied in for it, not the forward's copy."""
    model = prepare(build_peft_model(lora_dropout=0.0), device="cpu", head_on_host=True)
    host_head = engine_of(model).host_head
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    def first_grad() -> torch.Tensor:
        logits = model(input_ids=ids, use_cache=False).logits
        if host_head.loads % 2 == 1 and corrupt:
            host_head.host.mul_(2)  # what the backward will copy in
        logits.float().square().mean().backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        model.zero_grad(set_to_none=True)
        return grad

    corrupt = False
    clean = first_grad()
    assert host_head.loads == 2
    corrupt = True
    doubled = first_grad()
    host_head.host.div_(2)
    assert clean.abs().sum() > 0 and not torch.equal(clean, doubled)


def test_one_head_copy_per_step_is_exact(reference: dict) -> None:
    """head_copies=1: the forward's copy serves the backward too; one copy per step, every surface exact."""
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", head_on_host=True, head_copies=1)
    host_head = engine_of(model).host_head
    got = train_loop(model)
    assert differences(reference, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}
    assert host_head.loads == 3  # train_loop runs 3 steps
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids, use_cache=False).logits
    host_head.host.mul_(2)  # with two copies the backward would read these bytes (see the test above)
    logits.float().square().mean().backward()
    host_head.host.div_(2)
    assert host_head.loads == 4


def test_head_copied_when_it_runs_is_exact(reference: dict) -> None:
    """head_prefetch=False: no piece of the head is queued during the layers' forwards; every surface exact."""
    model = prepare(
        build_peft_model(lora_dropout=0.1), device="cpu", head_on_host=True, head_copies=1, head_prefetch=False
    )
    engine = engine_of(model)
    assert engine.host_head.on_layer_forward not in engine.streamer.on_forward
    got = train_loop(model)
    assert differences(reference, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}
    assert engine.host_head.loads == 3
    spread = engine_of(prepare(build_peft_model(), device="cpu", head_on_host=True))
    assert spread.host_head.on_layer_forward in spread.streamer.on_forward


def _inputs_offloaded(model: torch.nn.Module):
    offload = engine_of(model).streamer.inputs
    offload.min_bytes = 0  # the tiny model's hidden states are far below the default threshold
    return offload


def test_inputs_on_host_is_exact(reference: dict) -> None:
    """Each recomputing layer's input waits in host memory: one per layer and forward, every surface exact."""
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", inputs_on_host=True, keep_activations=1)
    offload = _inputs_offloaded(model)
    got = train_loop(model)
    assert differences(reference, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}
    assert offload.packed == 3 * 3  # 3 steps x the 3 layers that recompute (the last keeps its activations)


def test_inputs_on_host_recompute_reads_the_host_copy() -> None:
    """Negative control: bytes changed in host memory between forward and backward change the gradients."""

    def grads(corrupt: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model = prepare(build_peft_model(lora_dropout=0.0), device="cpu", inputs_on_host=True)
        offload = _inputs_offloaded(model)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=ids, use_cache=False).logits.float().square().mean()
        if corrupt:
            for refs in offload._by_layer.values():
                for ref in refs:
                    ref().host.mul_(1.5)
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        return loss.detach(), grad

    clean_loss, clean = grads(False)
    bad_loss, bad = grads(True)
    assert torch.equal(clean_loss, bad_loss) and not torch.equal(clean, bad)


def test_head_on_host_unprepare_and_tied_heads() -> None:
    model = prepare(build_peft_model(lora_dropout=0.0), device="cpu", head_on_host=True)
    head = model.get_base_model().lm_head
    unprepare(model)
    assert "forward" not in head.__dict__ and not getattr(head, "_poros_on_host", False)
    tied = prepare(
        build_peft_model(tiny_config(tie_word_embeddings=True), lora_dropout=0.0), device="cpu", head_on_host=True
    )
    assert engine_of(tied).host_head is None  # the table is the embedding's too: it stays on the device


def test_engine_options_are_validated() -> None:
    from poros_lightning.errors import PorosConfigError

    with pytest.raises(PorosConfigError, match="HINT"):
        prepare(build_peft_model(), device="cpu", block_size=0)
    with pytest.raises(PorosConfigError, match="num_slots"):
        prepare(build_peft_model(), device="cpu", prefetch=2, num_slots=2)
    model = build_peft_model()
    with pytest.raises(PorosConfigError, match="head_copies must be 1 or 2"):
        prepare(model, device="cpu", head_on_host=True, head_copies=3)
    assert engine_of(model) is None


def test_head_on_host_refuses_a_trained_head() -> None:
    from poros_lightning.errors import PorosConfigError

    model = build_peft_model(lora_dropout=0.0)
    model.get_base_model().lm_head.weight.requires_grad_(True)
    with pytest.raises(PorosConfigError, match="HINT: Drop head_on_host"):
        prepare(model, device="cpu", head_on_host=True)
    assert engine_of(model) is None  # refused before anything moved
    assert all("forward" not in layer.__dict__ for layer in model.get_base_model().model.layers)


def test_head_on_host_under_autocast_with_an_fp32_head() -> None:
    """Autocast casts an fp32 head for the matmul; the cast copy is what the graph saves, and it still leaves."""

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, use_cache=False).logits
        loss = logits.float().square().mean()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]

    def fp32_head(model: torch.nn.Module) -> torch.nn.Module:
        head = model.get_base_model().lm_head
        head.weight.data = head.weight.data.float()
        return model

    ref_loss, ref_grads = step(fp32_head(build_peft_model(lora_dropout=0.0)))
    model = prepare(fp32_head(build_peft_model(lora_dropout=0.0)), device="cpu", head_on_host=True)
    loss, grads = step(model)
    assert torch.equal(ref_loss, loss) and all(torch.equal(a, b) for a, b in zip(ref_grads, grads, strict=True))
    host_head = engine_of(model).host_head
    assert host_head.loads == 2 and host_head.host.dtype == torch.float32  # the backward copied it in again


def test_head_on_host_follows_a_replaced_weight() -> None:
    """A weight replaced between steps (``.to(dtype)``, ``load_state_dict(assign=True)``) is the one computed with."""
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(4))

    def logits(model: torch.nn.Module) -> torch.Tensor:
        head = model.get_base_model().lm_head
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)  # a first forward (it may leave a prefetched copy)
            head.weight.data = head.weight.data * 2  # new memory, new bytes
            return model(input_ids=ids, use_cache=False).logits

    ref = logits(build_peft_model(lora_dropout=0.0))
    model = prepare(build_peft_model(lora_dropout=0.0), device="cpu", head_on_host=True)
    assert torch.equal(ref, logits(model))
    head = model.get_base_model().lm_head
    assert head.weight.data_ptr() == engine_of(model).host_head.host.data_ptr()


@pytest.mark.parametrize(
    "options",
    [{"head_on_host": True}, {"head_on_host": True, "head_copies": 1, "inputs_on_host": True}],
    ids=["head", "one_head_copy_and_inputs"],
)
def test_a_retained_graph_backs_up_twice(options: dict) -> None:
    """backward(retain_graph=True) twice recomputes each streamed layer twice (copying host inputs back again, and
    reusing a kept head copy): grads equal the resident ones."""

    def twice(model: torch.nn.Module) -> list[torch.Tensor]:
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(6))
        loss = model(input_ids=ids, use_cache=False).logits.float().square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad for p in model.parameters() if p.requires_grad]

    ref = twice(build_peft_model(lora_dropout=0.0))
    model = prepare(build_peft_model(lora_dropout=0.0), device="cpu", **options)
    if options.get("inputs_on_host"):
        _inputs_offloaded(model)
    got = twice(model)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


@pytest.mark.parametrize("keep", [2, 4, 100])
def test_kept_activations_equal_resident(reference: dict, keep: int) -> None:
    """Layers that keep their activations skip the recompute; every surface stays exact."""
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", block_size=1, keep_activations=keep)
    engine = engine_of(model)
    assert engine.options.keep_activations == min(keep, 4)
    layers = model.get_base_model().model.layers
    calls = [0] * len(layers)
    for j, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(lambda *_, j=j: calls.__setitem__(j, calls[j] + 1))
    got = train_loop(model)
    assert differences(reference, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}
    kept = min(keep, 4)
    assert calls == [2 * 3] * (4 - kept) + [3] * kept  # the kept layers ran one forward per step
    assert engine.ring.loads == 6 + 4 + 4  # the backward still reloads every block that left its slot


def test_kept_activations_wrong_slot_negative_control(reference: dict) -> None:
    """Without a recompute the backward still reads the slot: a reload into the wrong one breaks the grads."""
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", block_size=1, keep_activations=4)
    engine_of(model).ring.fault = "wrong_slot"
    got = train_loop(model)
    assert torch.equal(reference["loss"][0], got["loss"][0])
    diff = differences(reference, got)
    assert diff["grads"] > 0 and diff["adapter"] > 0


@pytest.mark.parametrize("keep", [0, 4])
def test_reload_precedes_a_frozen_linear_without_lora(keep: int) -> None:
    """LoRA on q/v only: down_proj's backward saves nothing, and is the layer's first backward node.

    The output-gradient hook reloads the block before it (Note: [reload at the output's gradient]); the
    wrong-slot control shows those bytes are what the gradients read.
    """
    targets = ["q_proj", "v_proj"]
    ref = train_loop(build_peft_model(lora_dropout=0.0, targets=targets))
    model = prepare(build_peft_model(lora_dropout=0.0, targets=targets), device="cpu", keep_activations=keep)
    assert differences(ref, train_loop(model)) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}
    broken = prepare(build_peft_model(lora_dropout=0.0, targets=targets), device="cpu", keep_activations=keep)
    engine_of(broken).ring.fault = "wrong_slot"
    assert differences(ref, train_loop(broken))["grads"] > 0


def test_kept_activations_validated_and_refused_with_shared_kv() -> None:
    from test_arch import SHAPE_VARIANTS

    from poros_lightning.errors import PorosConfigError

    with pytest.raises(PorosConfigError, match="keep_activations must be >= 0"):
        prepare(build_peft_model(), device="cpu", keep_activations=-1)
    cfg = dict(SHAPE_VARIANTS["gemma4_text_kv_shared"])
    model = build_peft_model(cfg, lora_dropout=0.0, targets=["q_proj", "v_proj"])
    with pytest.raises(PorosConfigError, match="(?s)num_kv_shared_layers=2.*HINT: Use keep_activations=0"):
        prepare(model, device="cpu", keep_activations=2)
    assert engine_of(model) is None  # refused before anything moved


@pytest.fixture
def pinning(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], object]:
    """Pretend to be a CUDA machine for the host store: pinning succeeds, unregistered addresses are recorded.

    Returns the list of unregistered addresses and a factory of pinned stores over the tiny model's layers.
    """
    from poros_lightning import quant
    from poros_lightning.engine import store as store_module

    unregistered: list[int] = []

    class FakeCudart:
        def cudaHostUnregister(self, ptr: int) -> int:
            unregistered.append(ptr)
            return 0

    monkeypatch.setattr(store_module, "_cuda_pin", lambda arena: True)
    monkeypatch.setattr(store_module.torch.cuda, "cudart", lambda: FakeCudart())
    layers = build_peft_model(lora_dropout=0.0).get_base_model().model.layers
    layouts = [store_module.Layout.of(list(quant.streamable_tensors(x))) for x in layers]

    def filled_store() -> tuple[object, list[int]]:
        host = store_module.HostStore(layouts)
        host.pin_memory = True  # as on a CUDA machine
        return host, [host.fill(block).data_ptr() for block in range(len(host))]

    return unregistered, filled_store


def test_a_dropped_store_unregisters_its_pinned_arenas(pinning: tuple[list[int], object]) -> None:
    """Note: [unpin before free]: a store collected without release() still unregisters what it registered."""
    import gc

    unregistered, filled_store = pinning
    host, pointers = filled_store()
    del host
    gc.collect()
    assert sorted(unregistered) == sorted(pointers)
    released, _ = filled_store()
    released.release()
    count = len(unregistered)
    del released
    gc.collect()
    assert len(unregistered) == count == 2 * len(pointers)  # release() unregistered once; the finalizer found nothing


def test_a_deep_copied_store_leaves_the_original_registered(pinning: tuple[list[int], object]) -> None:
    import copy
    import gc

    unregistered, filled_store = pinning
    host, pointers = filled_store()
    clone = copy.deepcopy(host)
    clone.release()
    del clone
    gc.collect()
    assert unregistered == []  # the copy registered nothing, so it unregisters nothing
    host.release()
    assert sorted(unregistered) == sorted(pointers)


def test_kept_activations_are_not_planned_for_shared_kv_models() -> None:
    from test_arch import SHAPE_VARIANTS

    from poros_lightning.memory.planner import plan_engine

    cfg = dict(SHAPE_VARIANTS["gemma4_text_kv_shared"])
    assert plan_engine(cfg, "8GB", seq_len=16, lora_r=4).keep_activations == 0
    assert plan_engine(tiny_config(), "8GB", seq_len=16, lora_r=4).keep_activations == 4


def test_kept_activations_with_compiled_layers() -> None:
    """Each layer under torch.compile, every layer keeping its activations: equal to the compiled resident run."""
    from poros_lightning.training.compiling import compile_layers

    def compiled() -> torch.nn.Module:
        model = build_peft_model(lora_dropout=0.0)
        compile_layers(model)
        return model

    ref = train_loop(compiled(), steps=2)
    got = train_loop(prepare(compiled(), device="cpu", keep_activations=4), steps=2)
    assert differences(ref, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}


def test_an_input_grads_hook_is_named_with_its_fix(caplog: pytest.LogCaptureFixture) -> None:
    """enable_input_require_grads makes the backward compute and keep a gradient nobody reads; prepare() says so."""
    model = build_peft_model(lora_dropout=0.0)
    model.enable_input_require_grads()
    with caplog.at_level("WARNING", logger="poros_lightning.api"):
        prepare(model, device="cpu")
    assert "model.disable_input_require_grads()" in caplog.text
    unprepare(model)
    model.disable_input_require_grads()
    caplog.clear()
    with caplog.at_level("WARNING", logger="poros_lightning.api"):
        prepare(model, device="cpu")
    assert "require grad" not in caplog.text


class _FakeEvent:
    """A CUDA event stand-in: a tick of a counter, so that ``elapsed_time`` counts what was recorded between."""

    clock = 0

    def __init__(self) -> None:
        _FakeEvent.clock += 1
        self.at = _FakeEvent.clock

    def elapsed_time(self, other: _FakeEvent) -> float:
        return float(other.at - self.at)

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("keep", [0, 2, 4])
def test_timings_time_each_layer_once_per_forward_and_each_recompute_apart(
    monkeypatch: pytest.MonkeyPatch, keep: int
) -> None:
    """``compute_s``: one event pair per layer per forward (never in the recompute), inside the forward's pair;
    ``recompute_s``: one pair per recomputed layer per backward, none for a kept layer, per layer and forward."""
    from poros_lightning.engine import block

    monkeypatch.setattr(block, "_event", _FakeEvent)
    model = prepare(build_peft_model(tiny_config(num_hidden_layers=4)), device="cpu", keep_activations=keep)
    engine = engine_of(model)
    streamer = engine.streamer
    streamer.forward_events, streamer.layer_events, streamer.recompute_events = [], [], []  # as time_steps() on CUDA
    ids = torch.randint(0, 256, (1, 16))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    assert len(streamer.forward_events) == 2 and len(streamer.layer_events) == 2 * 4
    assert sorted(i for i, _, _ in streamer.recompute_events) == sorted(2 * list(range(4 - keep)))
    with torch.no_grad():  # an evaluation forward is not timed
        model(input_ids=ids)
    assert len(streamer.layer_events) == 2 * 4
    timed = engine.timings()
    # Each layer's pair spans one tick (nothing recorded inside it); the forward's pair spans the layers' pairs.
    assert timed["compute_s"] == pytest.approx(1e-3)  # one tick (a "millisecond") per block and forward
    assert timed["block_forward_s"] > timed["compute_s"] > 0
    assert timed["recompute_s"] == (pytest.approx(1e-3) if keep < 4 else 0.0)  # a tick per layer and backward


def test_timings_of_block_major_micro_batches_and_of_an_unfinished_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """k micro-batches: k pairs per layer in one forward; a forward that never finished (an error inside it) adds
    none of its layers' pairs to ``compute_s``."""
    from poros_lightning.engine import block
    from poros_lightning.engine.microbatch import MicroBatches

    monkeypatch.setattr(block, "_event", _FakeEvent)
    model = build_peft_model(tiny_config(num_hidden_layers=4), lora_dropout=0.0)
    base = model.get_base_model()
    MicroBatches(base, [*base.model.layers, base.model.norm, base.lm_head], 2).install()
    prepare(model, device="cpu")
    engine = engine_of(model)
    streamer = engine.streamer
    streamer.forward_events, streamer.layer_events, streamer.recompute_events = [], [], []
    ids = torch.randint(0, 256, (4, 16))
    model(input_ids=ids, use_cache=False).logits.float().mean().backward()
    assert len(streamer.forward_events) == 1 and len(streamer.layer_events) == 2 * 4
    assert len(streamer.recompute_events) == 2 * 4  # each micro-batch recomputes each layer on its own
    whole = engine.timings()["compute_s"]
    assert engine.timings()["recompute_s"] == pytest.approx(2e-3)  # a tick per pair, the 2 micro-batches' per layer
    streamer.forward_events.append([_FakeEvent(), None])  # a forward that stopped after two layers
    streamer.layer_events += [(_FakeEvent(), _FakeEvent()), (_FakeEvent(), _FakeEvent())]
    assert engine.timings()["compute_s"] == whole
