"""Block-major micro-batches (``PorosStrategy(micro_batches=k)``): each block once for all k, bit-identical.

The reference is layer-major gradient accumulation: k separate forward/backward passes of one
micro-batch each on a resident model (a plain loop, and Lightning's ``accumulate_grad_batches``).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import build_peft_model
from lightning.pytorch.strategies import SingleDeviceStrategy
from test_module import adapter_tensors, make_module, random_batches, trainer

from poros_lightning.api import engine_of, prepare
from poros_lightning.engine.microbatch import MicroBatches, micro_batch_mean
from poros_lightning.errors import PorosConfigError
from poros_lightning.lightning.strategy import PorosStrategy
from poros_lightning.tools.parity.runner import run_parity, token_loss

K, B, T, VOCAB = 3, 2, 16, 256
IDS = torch.randint(0, VOCAB, (K * B, T), generator=torch.Generator().manual_seed(3))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _layer_major() -> tuple[dict[str, torch.Tensor], int]:
    model = prepare(build_peft_model(lora_dropout=0.0), device="cpu", block_size=1)
    for i in range(K):
        ids = IDS[i * B : (i + 1) * B]
        (token_loss(model(input_ids=ids, use_cache=False).logits, ids) / K).backward()
    return _grads(model), engine_of(model).ring.loads


def _block_major(fault: str | None = None, head_on_host: bool = False) -> tuple[dict[str, torch.Tensor], int]:
    model = build_peft_model(lora_dropout=0.0)
    base = model.get_base_model()
    splitter = MicroBatches(base, [*base.model.layers, base.model.norm, base.lm_head], K)
    splitter.install()
    splitter.fault = fault
    prepare(model, device="cpu", block_size=1, head_on_host=head_on_host)
    total, _ = micro_batch_mean(token_loss, K, model(input_ids=IDS, use_cache=False).logits, IDS)
    total.backward()  # a plain backward: .grad is complete when it returns
    if head_on_host:  # one copy for the forward of all micro-batches, one shared by their backwards
        assert engine_of(model).host_head.loads == 2
    return _grads(model), engine_of(model).ring.loads


def test_block_major_gradients_equal_accumulation_and_each_block_loads_once() -> None:
    ref, ref_loads = _layer_major()
    got, loads = _block_major()
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    # 4 layers, 2 slots: layer-major reloads the blocks for every micro-batch, block-major once per pass
    assert loads < ref_loads / 2, (loads, ref_loads)


def test_each_micro_batch_of_a_layer_is_recomputed_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note: [one checkpoint per micro-batch]: a layer's recompute holds one micro-batch's activations, not k."""
    import poros_lightning.engine.block as block

    rows: list[int] = []
    run = block.LayerStreamer._run

    def recording(self, index, original, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if self._recomputing:
            rows.append(args[0].shape[0])
        return run(self, index, original, *args, **kwargs)

    monkeypatch.setattr(block.LayerStreamer, "_run", recording)
    _block_major()
    assert rows == [B] * (4 * K)  # 4 layers, each recomputed once per micro-batch of B rows


def test_a_parameters_gradients_are_summed_when_its_last_one_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note: [a parameter's sum when its last gradient arrives]: the store holds one layer's k gradients at a time."""
    import poros_lightning.engine.microbatch as mb

    most: list[int] = []
    keep = mb.MicroBatches.add_into_grad

    def counting(self, *params):  # noqa: ANN001, ANN002, ANN202
        most.append(len(self.store))
        keep(self, *params)

    monkeypatch.setattr(mb.MicroBatches, "add_into_grad", counting)
    ref, _ = _layer_major()
    got, _ = _block_major()
    assert all(torch.equal(ref[n], got[n]) for n in ref)  # the same additions, in the same order
    trained = len(ref)
    per_layer = trained // 4  # the tiny model's 4 decoder layers, LoRA A and B on each linear layer
    # summed as each parameter's last capture runs: never the k gradients of every parameter at once
    assert most and max(most) <= K * per_layer < K * trained, (max(most), K * trained)


def test_one_capture_per_layer_and_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host makes one capture call per module and micro-batch (all its LoRA tensors at once), not one per tensor:
    at one sample per micro-batch the step is bound by such host calls."""
    import poros_lightning.engine.microbatch as mb

    sizes: list[int] = []
    backward = mb._Capture.backward

    def counting(ctx, *grads):  # noqa: ANN001, ANN002, ANN202
        sizes.append(len(grads))
        return backward(ctx, *grads)

    monkeypatch.setattr(mb._Capture, "backward", staticmethod(counting))
    ref, _ = _layer_major()
    got, _ = _block_major()
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    assert len(sizes) == 4 * K and sum(sizes) == K * len(ref)  # 4 layers x K micro-batches, every LoRA tensor


def test_block_major_with_the_head_in_host_memory() -> None:
    """The head's weight is copied in per use; each micro-batch's backward unpacks its own copy."""
    ref, _ = _layer_major()
    got, _ = _block_major(head_on_host=True)
    assert all(torch.equal(ref[n], got[n]) for n in ref)


def test_summing_the_micro_batches_in_another_order_is_caught() -> None:
    """Negative control: the order of the gradient sum matters, and the comparison sees it."""
    ref, _ = _layer_major()
    got, _ = _block_major(fault="reversed_sum")
    assert not all(torch.equal(ref[n], got[n]) for n in ref)


@pytest.mark.parametrize("block_size", [1, 2])
def test_parity_gate_block_major(block_size: int) -> None:
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    result = run_parity(
        cfg, model="tiny", scale="tiny", steps=2, mode="block_major", block_size=block_size, seq_len=16, batch_size=2
    )
    assert result.equal, result.first_mismatch


def test_lora_module_block_major_equals_lightning_accumulation(tmp_path) -> None:
    """LoRALightningModule computes one loss per micro-batch; padded rows included (eager attention)."""
    ref = make_module(lora_dropout=0.0)
    trainer(tmp_path, max_steps=2, strategy=SingleDeviceStrategy("cpu"), accumulate_grad_batches=2).fit(
        ref, random_batches(n=8, batch_size=2)
    )
    got = make_module(lora_dropout=0.0)
    trainer(tmp_path, max_steps=2, strategy=PorosStrategy(device="cpu", micro_batches=2)).fit(
        got, random_batches(n=8, batch_size=4)
    )
    a, b = adapter_tensors(ref), adapter_tensors(got)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not any(n for n, m in got.model.named_modules() if "forward" in m.__dict__)  # teardown unwrapped


def test_a_short_last_batch_is_split_as_accumulation_splits_it(tmp_path) -> None:
    """10 rows in micro-batches of 2, k=2: the epoch's last batch holds one micro-batch, as Lightning's last window."""
    ref = make_module(lora_dropout=0.0)
    trainer(tmp_path, max_steps=4, strategy=SingleDeviceStrategy("cpu"), accumulate_grad_batches=2).fit(
        ref, random_batches(n=10, batch_size=2)
    )
    got = make_module(lora_dropout=0.0)
    trainer(tmp_path, max_steps=4, strategy=PorosStrategy(device="cpu", micro_batches=2)).fit(
        got, random_batches(n=10, batch_size=4)
    )
    a, b = adapter_tensors(ref), adapter_tensors(got)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_data_without_one_length_is_refused_and_scaling_that_rounds_warns() -> None:
    from types import SimpleNamespace

    strategy = PorosStrategy(device="cpu", micro_batches=3)
    data = SimpleNamespace(packing=False, pad_to_multiple_of=None, seq_len=32, batch_size=6)
    with pytest.raises(PorosConfigError, match="HINT: Set data.pad_to_multiple_of: 32"):
        strategy._check_block_major_data(SimpleNamespace(datamodule=data, accumulate_grad_batches=1))
    data.pad_to_multiple_of = 32
    assert strategy._check_block_major_data(SimpleNamespace(datamodule=data, accumulate_grad_batches=1)) == 2
    data.batch_size = 4
    with pytest.raises(PorosConfigError, match="not a multiple of micro_batches=3"):
        strategy._check_block_major_data(SimpleNamespace(datamodule=data, accumulate_grad_batches=1))
    data.batch_size = 6
    with pytest.warns(UserWarning, match="rounds differently"):  # fl(fl(1/25)/3) != fl(1/75)
        strategy._check_block_major_data(SimpleNamespace(datamodule=data, accumulate_grad_batches=25))


def test_dropout_is_refused_naming_the_fix(tmp_path) -> None:
    module = make_module(lora_dropout=0.1)
    with pytest.raises(PorosConfigError, match="HINT: Train on a CUDA device, set the LoRA dropout"):
        trainer(tmp_path, max_steps=1, strategy=PorosStrategy(device="cpu", micro_batches=2)).fit(
            module, random_batches(n=4, batch_size=4)
        )


def test_bad_values_are_refused() -> None:
    with pytest.raises(PorosConfigError, match="micro_batches must be a positive integer"):
        PorosStrategy(micro_batches=0)
    model = build_peft_model(lora_dropout=0.0)
    base = model.get_base_model()
    splitter = MicroBatches(base, [*base.model.layers, base.model.norm, base.lm_head], 4)
    splitter.install()
    with pytest.raises(PorosConfigError, match="multiple of micro_batches=4"):
        with torch.enable_grad():
            model(input_ids=IDS, use_cache=False)
    L.seed_everything(0, verbose=False)


def test_block_major_copies_the_host_optimizer_state_in_after_the_backward(tmp_path) -> None:
    """With the moments in host memory, block-major copies them in after the backward, not during its last
    quarter, which holds every micro-batch's gradients (Note: [when the state moves]): still exact."""
    ref = make_module(lora_dropout=0.0)
    trainer(tmp_path, max_steps=2, strategy=SingleDeviceStrategy("cpu"), accumulate_grad_batches=2).fit(
        ref, random_batches(n=8, batch_size=2)
    )
    got = make_module(lora_dropout=0.0)
    strategy = PorosStrategy(device="cpu", micro_batches=2, optimizer_on_host=True)
    trainer(tmp_path, max_steps=2, strategy=strategy).fit(got, random_batches(n=8, batch_size=4))
    a, b = adapter_tensors(ref), adapter_tensors(got)
    assert all(torch.equal(a[n], b[n]) for n in a)
    precision = strategy.precision_plugin
    assert precision.optimizer_on_host and not precision.optimizer_prefetch
    (host,) = precision._host_states.values()
    assert host._trigger is None and host.prefetches == 0
    assert PorosStrategy(device="cpu", optimizer_on_host=True).precision_plugin.optimizer_prefetch
