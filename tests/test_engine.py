"""The engine on its own (no Lightning): streamed training is torch.equal to resident training."""

from __future__ import annotations

import pytest
import torch
from conftest import build_peft_model, tiny_config

from poros_lightning import prepare, unprepare
from poros_lightning.api import engine_of


def _train(model: torch.nn.Module, steps: int = 3, accumulate: int = 1) -> dict:
    """A plain loop; returns per-step losses and grads, final adapter and optimizer state."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(123)
    losses, grads = [], []
    for _ in range(steps):
        for _ in range(accumulate):
            ids = torch.randint(0, 256, (2, 16), generator=gen)
            logits = model(input_ids=ids, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 256), ids[:, 1:].reshape(-1))
            (loss / accumulate).backward()
            losses.append(loss.detach())
        grads.append([p.grad.clone() for p in params])
        opt.step()
        opt.zero_grad()
    state = [t for s in opt.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)]
    return {
        "loss": losses,
        "grads": grads,
        "adapter": dict(zip(names, [p.detach().clone() for p in params], strict=False)),
        "optim": state,
    }


def _differences(ref: dict, got: dict) -> dict[str, int]:
    return {
        "loss": sum(not torch.equal(a, b) for a, b in zip(ref["loss"], got["loss"], strict=True)),
        "grads": sum(
            not torch.equal(a, b)
            for sa, sb in zip(ref["grads"], got["grads"], strict=True)
            for a, b in zip(sa, sb, strict=False)
        ),
        "adapter": sum(not torch.equal(ref["adapter"][k], got["adapter"][k]) for k in ref["adapter"]),
        "optim": sum(not torch.equal(a, b) for a, b in zip(ref["optim"], got["optim"], strict=True)),
    }


@pytest.fixture(scope="module")
def reference() -> dict:
    return _train(build_peft_model(lora_dropout=0.1))


@pytest.mark.parametrize("block_size", [1, 2])
def test_streamed_equals_resident(reference: dict, block_size: int) -> None:
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", block_size=block_size)
    got = _train(model)
    assert _differences(reference, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}


def test_more_blocks_than_slots_reuses_slots(reference: dict) -> None:
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", block_size=1)
    engine = engine_of(model)
    assert engine.num_blocks == 4 and engine.options.num_slots == 2
    got = _train(model)
    assert _differences(reference, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}
    # first step: 4 forward loads + 2 backward reloads; later steps 4 each (the turns reuse slots)
    assert engine.ring.loads == 6 + 4 + 4


def test_wrong_slot_negative_control(reference: dict) -> None:
    """Reloading a block into another block's slot breaks the gradients: the parity test can fail."""
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu", block_size=1)
    engine_of(model).ring.fault = "wrong_slot"
    got = _train(model)
    diff = _differences(reference, got)
    assert torch.equal(reference["loss"][0], got["loss"][0])  # the forward is still exact
    assert diff["grads"] > 0 and diff["adapter"] > 0


def test_gradient_accumulation() -> None:
    ref = _train(build_peft_model(lora_dropout=0.1), steps=2, accumulate=2)
    got = _train(prepare(build_peft_model(lora_dropout=0.1), device="cpu"), steps=2, accumulate=2)
    assert _differences(ref, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}


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
    ref = _train(build_peft_model(cfg, quantization="none"))
    got = _train(prepare(build_peft_model(cfg, quantization="none"), device="cpu"))
    assert _differences(ref, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}
