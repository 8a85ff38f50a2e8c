"""Block-major micro-batches with dropout: each (micro-batch, layer) draws where layer-major accumulation draws.

On CUDA dropout draws from a Philox counter (seed, offset); the CPU generator has no offset. These tests give
the layers a counter-based dropout on a stand-in generator with ``get_offset``/``set_offset``, whose every
launch moves the offset by an amount fixed by its shape, as CUDA's does: the replay machinery (the probe per
micro-batch shape, the offsets of each chunk, the recompute in the backward, the checks) runs on the CPU
against a reference that shares no engine code. The same replay on the H200's generator is the GPU gate
``poros-lightning parity --config configs/parity/qwen2.5-7b-block-major-dropout.yaml``.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_peft_model
from torch import nn

from poros_lightning.api import check_block_major, prepare
from poros_lightning.engine.microbatch import MicroBatches, micro_batch_mean
from poros_lightning.errors import PorosConfigError, PorosError
from poros_lightning.tools.parity.runner import token_loss

K, B, T, VOCAB = 3, 2, 16, 256
IDS = torch.randint(0, VOCAB, (K * B + 1, T), generator=torch.Generator().manual_seed(5))


class CounterRNG:
    """A stand-in for the CUDA generator: only an offset, read and set.

    The offset lives in the CPU generator's seed, so that an activation checkpoint, which records the CPU
    generator's state before a forward and restores it for the recompute, restores the offset as it restores the
    CUDA generator's (seed and offset) on a GPU.
    """

    def __init__(self) -> None:
        torch.manual_seed(0)

    @property
    def offset(self) -> int:
        return torch.initial_seed()

    @offset.setter
    def offset(self, value: int) -> None:
        torch.manual_seed(value)

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


class CounterDropout(nn.Module):
    """Dropout whose mask is a function of the generator's offset; each call moves it by a shape-fixed amount."""

    def __init__(self, p: float, rng: CounterRNG, skew: bool = False) -> None:
        super().__init__()
        self.p, self.rng, self.skew = p, rng, skew

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        g = torch.Generator().manual_seed(self.rng.offset)
        keep = (torch.rand(x.shape, generator=g) >= self.p).to(x.dtype)
        step = 4 * math.ceil(x.numel() / 64)
        if self.skew and torch.is_grad_enabled():  # negative control: draws more when recording gradients
            step += 4
        self.rng.offset += step
        return x * keep / (1 - self.p)


def _model(rng: CounterRNG, skew: bool = False) -> nn.Module:
    model = build_peft_model(lora_dropout=0.1)
    for module in model.modules():
        drops = getattr(module, "lora_dropout", None)
        if isinstance(drops, nn.ModuleDict):
            for name in list(drops):
                drops[name] = CounterDropout(0.1, rng, skew)
    return model


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _layer_major(ids: torch.Tensor, sizes: list[int]) -> tuple[dict[str, torch.Tensor], int]:
    """Plain PEFT, resident: one forward/backward per micro-batch, losses divided by the micro-batch count."""
    rng = CounterRNG()
    model = _model(rng)
    start = 0
    for n in sizes:
        part = ids[start : start + n]
        (token_loss(model(input_ids=part, use_cache=False).logits, part) / K).backward()
        start += n
    return _grads(model), rng.offset


def _block_major(
    ids: torch.Tensor, replay: bool = True, skew: bool = False, micro_size: int | None = B
) -> tuple[dict[str, torch.Tensor], int, MicroBatches]:
    rng = CounterRNG()
    model = _model(rng, skew)
    base = model.get_base_model()
    layers = list(base.model.layers)
    splitter = MicroBatches(
        base,
        [*layers, base.model.norm, base.lm_head],
        K,
        layers=len(layers),
        body=base.model if replay else None,
        rng=(lambda device: rng) if replay else None,
    )
    splitter.micro_size = micro_size
    splitter.install()
    prepare(model, device="cpu", block_size=1, keep_activations=1)  # 3 layers recompute in the backward, 1 keeps
    sizes = splitter.sizes(ids.shape[0])
    total, _ = micro_batch_mean(token_loss, K, model(input_ids=ids, use_cache=False).logits, ids, sizes=sizes)
    total.backward()
    return _grads(model), rng.offset, splitter


def test_block_major_with_dropout_equals_layer_major_accumulation() -> None:
    ids = IDS[: K * B]
    ref, ref_offset = _layer_major(ids, [B] * K)
    got, offset, splitter = _block_major(ids)
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    assert offset == ref_offset  # the next step starts where layer-major accumulation's would
    assert splitter.replay.probes == 1
    # Negative control: the same block-major run without the replay draws other masks.
    unplaced, _, _ = _block_major(ids, replay=False)
    assert not all(torch.equal(ref[n], unplaced[n]) for n in ref)


def test_a_short_last_batch_gets_its_own_probe_and_stays_exact() -> None:
    ids = IDS[: K * B - 1]  # micro-batches of 2, 2 and 1 rows
    ref, ref_offset = _layer_major(ids, [B, B, B - 1])
    got, offset, splitter = _block_major(ids)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    assert offset == ref_offset
    assert splitter.replay.probes == 2


def test_a_draw_the_probe_did_not_see_stops_the_step() -> None:
    with pytest.raises(PorosError, match="moved the RNG offset by"):
        _block_major(IDS[: K * B], skew=True)


def test_a_dropout_outside_the_layers_is_refused_by_the_probe() -> None:
    rng = CounterRNG()
    model = _model(rng)
    base = model.get_base_model()
    embed = base.model.embed_tokens
    embed_forward = embed.forward
    drop = CounterDropout(0.1, rng)
    embed.forward = lambda *a, **kw: drop(embed_forward(*a, **kw))
    layers = list(base.model.layers)
    splitter = MicroBatches(
        base, [*layers, base.model.norm, base.lm_head], K, layers=len(layers), body=base.model, rng=lambda d: rng
    )
    splitter.install()
    with pytest.raises(PorosConfigError, match="outside its decoder layers"):
        model(input_ids=IDS[: K * B], use_cache=False)


def test_dropout_is_refused_off_cuda_and_outside_the_layers() -> None:
    model = build_peft_model(lora_dropout=0.1)
    with pytest.raises(PorosConfigError, match="HINT: Train on a CUDA device"):
        check_block_major(model, "PorosStrategy(micro_batches=2)", "accumulate_grad_batches=2", device="cpu")
    assert check_block_major(build_peft_model(lora_dropout=0.0), "x", "y", device="cpu") is False
    base = model.get_base_model()
    base.model.embed_dropout = nn.Dropout(0.1)  # a dropout module outside the decoder layers
    with pytest.raises(PorosConfigError, match="model.embed_dropout"):
        check_block_major(model, "PorosStrategy(micro_batches=2)", "accumulate_grad_batches=2", device="cuda")
    del base.model.embed_dropout
    assert check_block_major(model, "PorosStrategy(micro_batches=2)", "accumulate_grad_batches=2", device="cuda")


def _installed(rng: CounterRNG) -> tuple[nn.Module, MicroBatches]:
    model = _model(rng)
    base = model.get_base_model()
    layers = list(base.model.layers)
    splitter = MicroBatches(
        base, [*layers, base.model.norm, base.lm_head], K, layers=len(layers), body=base.model, rng=lambda d: rng
    )
    splitter.micro_size = B
    splitter.install()
    prepare(model, device="cpu", block_size=1)
    return model, splitter


def test_a_second_forward_before_the_backward_is_refused() -> None:
    """The first forward's recompute needs its own offsets: a second forward recording gradients would replace them."""
    model, _ = _installed(CounterRNG())
    ids = IDS[: K * B]
    model(input_ids=ids, use_cache=False)
    with pytest.raises(PorosError, match="before the backward of the first"):
        model(input_ids=ids, use_cache=False)


def test_a_draw_after_the_decoder_stops_the_step() -> None:
    rng = CounterRNG()
    model, _ = _installed(rng)
    ids = IDS[: K * B]
    logits = model(input_ids=ids, use_cache=False).logits
    loss = micro_batch_mean(token_loss, K, CounterDropout(0.1, rng)(logits), ids)[0]  # a dropout in the loss
    with pytest.raises(PorosError, match="after the decoder stack"):
        loss.backward()
    # one forward, one backward: the next step runs
    logits = model(input_ids=ids, use_cache=False).logits
    micro_batch_mean(token_loss, K, logits, ids)[0].backward()
