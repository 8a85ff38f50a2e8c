"""LoRALightningModule(loss_chunk_tokens=n): the LM head and the loss in token chunks.

Streamed equals resident bit for bit with the option on (torch.equal on the four surfaces, LoRA dropout > 0,
the head in host memory, block-major micro-batches); against the unchunked loss the difference is measured
and bounded (``test_chunked_loss_is_close_to_the_unchunked_loss`` prints the numbers docs/parity.md quotes).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from test_arch import TINY
from test_module import TINY_QWEN2, make_module, random_batches, trainer
from test_strategy import Recorder, _assert_equal

from poros_lightning import PorosStrategy
from poros_lightning.api import engine_of
from poros_lightning.arch import get_arch, resolve
from poros_lightning.errors import PorosConfigError
from poros_lightning.training.chunked_loss import chunked_causal_lm_loss, final_logit_softcap
from poros_lightning.training.module import causal_lm_loss

CHUNK = 7  # divides neither a row (32 positions) nor a batch (4 x 32): the last chunk of each is short


class HeadLoads(L.Callback):
    """Copies of the host head's weight per training step."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._last = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        head = engine_of(module.model).host_head
        self.per_step.append(head.loads - self._last)
        self._last = head.loads


def _fit(tmp_path, strategy, *, steps: int = 3, callbacks=(), data=None, accumulate: int = 1, **module_kwargs):  # noqa: ANN001, ANN003
    rec = Recorder()
    module = make_module(**{"lora_dropout": 0.1, "loss_chunk_tokens": CHUNK, **module_kwargs})
    trainer(
        tmp_path, max_steps=steps, strategy=strategy, callbacks=[rec, *callbacks], accumulate_grad_batches=accumulate
    ).fit(module, data if data is not None else random_batches(n=8, batch_size=2))
    return rec


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Recorder:  # noqa: ANN001
    return _fit(tmp_path_factory.mktemp("ref"), SingleDeviceStrategy("cpu"))


@pytest.mark.parametrize(
    "options",
    [
        {"block_size": 1},
        {"block_size": 2},
        {"head_on_host": True},
        {"head_on_host": True, "head_copies": 1, "embeddings_on_host": True},
    ],
    ids=["block1", "block2", "head_on_host", "head_copies1"],
)
def test_chunked_loss_streamed_equals_resident(reference: Recorder, tmp_path, options: dict) -> None:
    """Loss, gradient norms, adapter and optimizer state torch.equal; LoRA dropout 0.1."""
    loads = HeadLoads() if options.get("head_on_host") else None
    got = _fit(tmp_path, PorosStrategy(device="cpu", **options), callbacks=[loads] if loads else [])
    _assert_equal(reference, got)
    if loads is not None:  # one copy for all chunks' forward, one for their backward (or one in all)
        assert loads.per_step == [options.get("head_copies", 2)] * 3


def test_the_planner_reads_the_chunk_size_off_the_module(reference: Recorder, tmp_path) -> None:
    """A budget that moves the head to host memory (one copy, as with chunks it costs nothing): still exact."""
    strategy = PorosStrategy(device="cpu", vram_budget=540_000, seq_len=32)
    _assert_equal(reference, _fit(tmp_path, strategy))
    plan = strategy.plans[0]
    assert f"in chunks of {CHUNK} tokens" in plan.explanation[0]
    assert plan.head_on_host and plan.head_copies == 1


def test_chunked_loss_with_lora_on_the_head_replays_its_dropout(tmp_path) -> None:
    """A trained head with dropout: the recompute draws the forward's masks, streamed and resident alike."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    ref = _fit(tmp_path, SingleDeviceStrategy("cpu"), steps=2, target_modules=targets)
    got = _fit(tmp_path, PorosStrategy(device="cpu"), steps=2, target_modules=targets)
    _assert_equal(ref, got)
    assert any("lm_head" in name for name in got.adapter)


def _head_and_hidden(dropout: float) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Dropout(dropout), torch.nn.Linear(16, 40))
    hidden = torch.randn(3, 10, 16, requires_grad=True)
    labels = torch.randint(0, 40, (3, 10))
    labels[1, :4] = -100
    return head, hidden, labels


def test_the_backward_recomputes_the_forward_dropout_masks() -> None:
    """Against the same chunks kept in one graph (no recompute): the hidden gradient is torch.equal."""
    head, hidden, labels = _head_and_hidden(0.5)
    torch.manual_seed(1)
    loss = chunked_causal_lm_loss(hidden, labels, head, CHUNK)
    after_forward = torch.get_rng_state()
    loss.backward()
    assert torch.equal(torch.get_rng_state(), after_forward)  # the replay leaves the generator as it was
    got = hidden.grad.clone()

    hidden.grad = None
    torch.manual_seed(1)
    flat = hidden.reshape(-1, 16)
    targets = torch.cat([labels[:, 1:], torch.full((3, 1), -100)], 1).reshape(-1)
    parts = [
        torch.nn.functional.cross_entropy(head(flat[s : s + CHUNK]).float(), targets[s : s + CHUNK], reduction="sum")
        for s in range(0, 30, CHUNK)
    ]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    expected_loss = total / (targets != -100).sum()
    expected_loss.backward()
    assert torch.equal(loss, expected_loss)
    assert torch.equal(got, hidden.grad)


def test_a_recompute_without_the_replayed_draws_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: new dropout masks in the backward change the hidden gradient, and the test sees it."""
    import poros_lightning.training.chunked_loss as chunked

    head, hidden, labels = _head_and_hidden(0.5)
    grads = []
    for replay in (True, False):
        monkeypatch.setattr(chunked, "_draws_random", lambda module, replay=replay: replay)
        hidden.grad = None
        torch.manual_seed(1)
        chunked_causal_lm_loss(hidden, labels, head, CHUNK).backward()
        grads.append(hidden.grad.clone())
    assert not torch.equal(grads[0], grads[1])


def test_trained_head_parameters_get_their_gradient() -> None:
    head, hidden, labels = _head_and_hidden(0.0)
    chunked_causal_lm_loss(hidden, labels, head, CHUNK).backward()
    got = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    logits = head(hidden)
    causal_lm_loss(logits, labels).backward()
    for a, b in zip(got, head.parameters(), strict=True):
        torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-6)


def test_block_major_micro_batches_equal_lightning_accumulation(tmp_path) -> None:
    """One chunked loss per micro-batch; the head in host memory: one copy per step for all micro-batches."""
    kwargs = {"lora_dropout": 0.0, "steps": 2}
    ref = _fit(tmp_path, SingleDeviceStrategy("cpu"), accumulate=2, **kwargs)
    loads = HeadLoads()
    got = _fit(
        tmp_path,
        PorosStrategy(device="cpu", micro_batches=2, head_on_host=True, head_copies=1),
        data=random_batches(n=8, batch_size=4),
        callbacks=[loads],
        **kwargs,
    )
    assert all(torch.equal(ref.adapter[n], got.adapter[n]) for n in ref.adapter)
    assert all(torch.equal(a, b) for a, b in zip(ref.optim, got.optim, strict=True))
    assert loads.per_step == [1, 1]


def test_block_major_micro_batches_refuse_a_trained_head(tmp_path) -> None:
    targets = ["q_proj", "lm_head"]
    with pytest.raises(PorosConfigError, match="HINT: Leave the LM head out of target_modules"):
        _fit(tmp_path, PorosStrategy(device="cpu", micro_batches=2), lora_dropout=0.0, target_modules=targets)


def _losses_and_grads(module, batch, chunk: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
    module.zero_grad()
    module.loss_chunk_tokens = chunk
    torch.manual_seed(11)  # the same LoRA dropout masks for both
    loss = module._chunked_loss(batch) if chunk else causal_lm_loss(module(batch), batch["labels"])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}


def measure_chunked_vs_unchunked(model_config: dict, chunks: list[int], steps: int = 4) -> dict[int, dict[str, float]]:
    """Max differences of loss and LoRA gradients, chunked vs unchunked, at the same weights each step.

    Each step computes both on the same adapter (then steps the optimizer with the unchunked gradients), so
    the numbers are one step's differences, not a drift of two trajectories.
    """
    module = make_module(model_config=model_config, lora_dropout=0.1, loss_chunk_tokens=max(chunks))
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    worst = {c: {"loss_abs": 0.0, "loss_rel": 0.0, "grad_abs": 0.0, "grad_rel": 0.0} for c in chunks}
    for batch in random_batches(n=4 * steps, batch_size=4):
        loss, grads = _losses_and_grads(module, batch, None)
        for c in chunks:
            got_loss, got_grads = _losses_and_grads(module, batch, c)
            w = worst[c]
            w["loss_abs"] = max(w["loss_abs"], (got_loss - loss).abs().item())
            w["loss_rel"] = max(w["loss_rel"], ((got_loss - loss).abs() / loss.abs()).item())
            for n, g in grads.items():
                diff = (got_grads[n] - g).abs().max().item()
                w["grad_abs"] = max(w["grad_abs"], diff)
                w["grad_rel"] = max(w["grad_rel"], diff / max(g.abs().max().item(), 1e-30))
        for n, p in module.named_parameters():
            if p.requires_grad:
                p.grad = grads[n]
        optimizer.step()
    return worst


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
def test_chunked_loss_is_close_to_the_unchunked_loss(family: str) -> None:
    """Regenerates the table in docs/parity.md: pytest -s tests/test_chunked_loss.py -k unchunked."""
    cfg = dict(TINY_QWEN2, model_type=family)
    if family == "gemma3_text":
        cfg.update(final_logit_softcapping=0.5, head_dim=16)  # a cap small enough to matter on random logits
    worst = measure_chunked_vs_unchunked(cfg, [CHUNK, 64, 4 * 32])
    for chunk, w in worst.items():
        print(
            f"{family} chunk {chunk}: loss max abs {w['loss_abs']:.3g} rel {w['loss_rel']:.3g}; "
            f"LoRA grads max abs {w['grad_abs']:.3g} rel (to the tensor's max) {w['grad_rel']:.3g}"
        )
        assert w["loss_rel"] < 1e-6 and w["grad_rel"] < 1e-5, (chunk, w)


def _family_model(model_type: str) -> torch.nn.Module:
    import transformers
    from test_parity_families import _config

    cfg = _config(model_type)
    text = cfg.get("text_config", cfg)
    text["final_logit_softcapping"] = 0.5  # where the family's forward applies it, it changes the logits
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    if model_type == "qwen3_5":
        return transformers.Qwen3_5ForConditionalGeneration(config).eval()
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_registry_body_head_and_softcap_give_the_models_logits(model_type: str) -> None:
    """head(body(x)), soft-capped where the registry says, torch.equal to the model's own logits."""
    model = _family_model(model_type)
    spec = get_arch(model_type)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        hidden = resolve(model, spec.body)(input_ids=ids, use_cache=False).last_hidden_state
        logits = resolve(model, spec.head)(hidden)
        cap = final_logit_softcap(model.config, spec)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
    assert (cap is not None) == (model_type in ("gemma3_text", "gemma4_text", "gemma4"))
    assert torch.equal(logits, expected)


def test_validation_matches_the_unchunked_metrics(tmp_path) -> None:
    module = make_module(loss_chunk_tokens=CHUNK)
    t = trainer(tmp_path)
    chunked = t.validate(module, random_batches(), verbose=False)[0]
    module.loss_chunk_tokens = None
    unchunked = t.validate(module, random_batches(), verbose=False)[0]
    assert chunked["val/token_acc"] == unchunked["val/token_acc"]
    assert chunked["val/loss"] == pytest.approx(unchunked["val/loss"], rel=1e-6)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "512"])
def test_bad_chunk_sizes_are_refused(value: object) -> None:
    with pytest.raises(
        PorosConfigError, match="(?s)loss_chunk_tokens must be a positive integer.*HINT: Set model.loss_chunk_tokens"
    ):
        make_module(loss_chunk_tokens=value)


def test_an_unlisted_model_with_a_soft_cap_is_refused() -> None:
    from dataclasses import replace

    spec = replace(get_arch("qwen2"), model_type="mystery", guessed=True)
    config = type("Config", (), {"final_logit_softcapping": 30.0})()
    with pytest.raises(PorosConfigError, match="HINT: Leave loss_chunk_tokens unset"):
        final_logit_softcap(config, spec)
    assert final_logit_softcap(type("Config", (), {})(), spec) is None


@pytest.mark.parametrize("chunk", [1, 10_000])
def test_one_token_chunks_and_one_chunk_for_all_stream_exactly(tmp_path, chunk: int) -> None:
    ref = _fit(tmp_path, SingleDeviceStrategy("cpu"), steps=1, loss_chunk_tokens=chunk)
    _assert_equal(ref, _fit(tmp_path, PorosStrategy(device="cpu"), steps=1, loss_chunk_tokens=chunk))
