"""PorosStrategy under Lightning vs plain PEFT under SingleDeviceStrategy: four surfaces torch.equal.

The reference shares no engine code: the same LightningModule (a user's own, holding a PEFT model)
trained by Lightning's SingleDeviceStrategy on a resident bitsandbytes model.
"""

from __future__ import annotations

import gc

import lightning as L
import pytest
import torch
from conftest import build_peft_model
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader

import poros_lightning  # noqa: F401  (registers "poros")
from poros_lightning import PorosStrategy
from poros_lightning.api import engine_of


class UserModule(L.LightningModule):
    """A user's own module: any LightningModule holding a PEFT-wrapped HF causal LM."""

    def __init__(self, lora_dropout: float) -> None:
        super().__init__()
        self.net = build_peft_model(lora_dropout=lora_dropout)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(input_ids=batch, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 256), batch[:, 1:].reshape(-1))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class Recorder(L.Callback):
    """Records the four parity surfaces."""

    def __init__(self) -> None:
        self.loss: list[torch.Tensor] = []
        self.grad_norm: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.loss.append(outputs["loss"].detach().cpu())

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:  # noqa: ANN001
        norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
        self.grad_norm.append(torch.stack(norms).norm().cpu())

    def on_train_end(self, trainer, module) -> None:  # noqa: ANN001
        self.adapter = {n: p.detach().cpu().clone() for n, p in module.named_parameters() if p.requires_grad}
        opt = trainer.optimizers[0].state_dict()["state"]
        self.optim = [t.detach().cpu().clone() for s in opt.values() for t in s.values() if torch.is_tensor(t)]


def _data(n: int = 8) -> DataLoader:
    gen = torch.Generator().manual_seed(7)
    return DataLoader(torch.randint(0, 256, (n, 16), generator=gen), batch_size=2, shuffle=False)


def _fit(strategy, lora_dropout=0.1, accumulate=1, sanity=False, rec=None) -> Recorder:  # noqa: ANN001
    L.seed_everything(0, verbose=False)
    module = UserModule(lora_dropout)
    rec = rec if rec is not None else Recorder()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_steps=3,
        accumulate_grad_batches=accumulate,
        callbacks=[rec],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=2 if sanity else 0,
        limit_val_batches=2 if sanity else 0,
    )
    trainer.fit(module, _data(), _data(4) if sanity else None)
    return rec


def _assert_equal(ref: Recorder, got: Recorder) -> None:
    assert len(ref.loss) == len(got.loss) and all(torch.equal(a, b) for a, b in zip(ref.loss, got.loss, strict=False))
    assert all(torch.equal(a, b) for a, b in zip(ref.grad_norm, got.grad_norm, strict=True))
    assert ref.adapter.keys() == got.adapter.keys()
    assert all(torch.equal(ref.adapter[k], got.adapter[k]) for k in ref.adapter)
    assert all(torch.equal(a, b) for a, b in zip(ref.optim, got.optim, strict=True))


@pytest.fixture(scope="module")
def reference() -> Recorder:
    return _fit(SingleDeviceStrategy("cpu"))


@pytest.mark.parametrize("block_size", [1, 2])
def test_poros_equals_resident(reference: Recorder, block_size: int) -> None:
    _assert_equal(reference, _fit(PorosStrategy(block_size=block_size)))


class FreezeCount(Recorder):
    """The four surfaces, and how many objects Python's collector leaves out while each step runs."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:  # noqa: ANN001
        self.frozen = [*getattr(self, "frozen", []), gc.get_freeze_count()]


def test_setup_is_frozen_for_the_collector_while_training(reference: Recorder) -> None:
    # Note: [frozen setup]: the model and what setup built are left out of collections during training,
    # thawed at the end, and no result changes; gc_freeze=False leaves the collector alone.
    assert gc.get_freeze_count() == 0
    for enabled in (True, False):
        rec = FreezeCount()
        _assert_equal(reference, _fit(PorosStrategy(gc_freeze=enabled), rec=rec))
        assert len(rec.frozen) == 3
        assert all(n > 1000 for n in rec.frozen) if enabled else rec.frozen == [0, 0, 0]
        assert gc.get_freeze_count() == 0  # thawed when training ended


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_collector_is_frozen_by_default_thawed_on_every_exit_and_a_users_freeze_is_kept() -> None:
    import weakref

    from poros_lightning.lightning.ddp import PorosDDPStrategy

    for strategy in (PorosStrategy(), PorosDDPStrategy()):
        assert strategy.collector.enabled  # the default
        garbage = weakref.ref(Cycle())  # a cycle only the collector frees: collected before the freeze
        strategy.on_train_start()
        assert garbage() is None and gc.get_freeze_count() > 1000
        strategy.on_train_end()
        assert gc.get_freeze_count() == 0  # teardown thaws too: test_a_fit_that_raises_leaves_the_collector_thawed
    assert not PorosDDPStrategy(gc_freeze=False).collector.enabled
    gc.freeze()  # the user's own freeze (before forking workers, say): left as it is
    try:
        strategy = PorosStrategy()
        strategy.on_train_start()
        assert not strategy.collector.frozen
        strategy.on_train_end()
        assert gc.get_freeze_count() > 1000  # not thawed
    finally:
        gc.unfreeze()


class Failing(UserModule):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise RuntimeError("a step that fails")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_raises_leaves_the_collector_thawed() -> None:
    trainer = L.Trainer(strategy=PorosStrategy(), accelerator="cpu", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with pytest.raises(RuntimeError, match="a step that fails"):
        trainer.fit(Failing(0.0), _data())
    assert gc.get_freeze_count() == 0


def test_registered_name(reference: Recorder) -> None:
    _assert_equal(reference, _fit("poros"))


def test_gradient_accumulation() -> None:
    ref = _fit(SingleDeviceStrategy("cpu"), accumulate=2)
    _assert_equal(ref, _fit(PorosStrategy(), accumulate=2))


def test_sanity_validation_before_training() -> None:
    ref = _fit(SingleDeviceStrategy("cpu"), sanity=True)
    _assert_equal(ref, _fit(PorosStrategy(), sanity=True))


def test_checkpoint_holds_only_the_adapter(tmp_path) -> None:  # noqa: ANN001
    L.seed_everything(0, verbose=False)
    module = UserModule(0.0)
    trainer = L.Trainer(
        strategy=PorosStrategy(),
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, _data(2))
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert state and all("lora_" in k for k in state)
    assert engine_of(module.net) is None  # teardown gave the base its memory back


def test_vram_budget_plans_the_engine(reference: Recorder) -> None:
    """A budget the planner fills with resident blocks still trains exactly."""
    strategy = PorosStrategy(vram_budget="1GB", seq_len=16)
    _assert_equal(reference, _fit(strategy))
    assert strategy.plans and strategy.plans[0].resident_blocks == 2  # all but the two ring slots


def test_tight_vram_budget_turns_on_the_minimum_memory_options(reference: Recorder) -> None:
    """Below the smallest plan, the planner moves embeddings, head and optimizer moments to the host: still exact."""
    strategy = PorosStrategy(vram_budget=778_000, seq_len=16)
    _assert_equal(reference, _fit(strategy))
    plan = strategy.plans[0]
    assert plan.embeddings_on_host and plan.head_on_host and plan.optimizer_on_host
    assert strategy.precision_plugin.optimizer_on_host and strategy.precision_plugin._host_states


def test_vram_budget_too_small_names_the_minimum() -> None:
    from poros_lightning.errors import PorosOOMError

    with pytest.raises(PorosOOMError, match="vram_budget >= "):
        _fit(PorosStrategy(vram_budget=10_000, seq_len=16))


def test_optimizer_state_on_host_between_steps(reference: Recorder) -> None:
    """optimizer_on_host=True: same bytes, and between steps the moments live in the strategy's host buffers."""
    strategy = PorosStrategy(optimizer_on_host=True)
    _assert_equal(reference, _fit(strategy))
    host = next(iter(strategy.precision_plugin._host_states.values()))
    moved = [(p, k) for p, state in host.optimizer.state.items() for k in ("exp_avg", "exp_avg_sq")]
    assert moved and all(host.optimizer.state[p][k] is host.buffers[(id(p), k)] for p, k in moved)
    assert all(host.optimizer.state[p]["step"].dim() == 0 for p, _ in moved)  # scalars stay where they were


def test_trainer_precision_flag_reaches_a_strategy_instance() -> None:
    """Trainer(precision="bf16-mixed") with PorosStrategy(...) trains under autocast, bit-identical to resident."""

    def fit(strategy) -> tuple[Recorder, L.Trainer]:  # noqa: ANN001
        L.seed_everything(0, verbose=False)
        rec = Recorder()
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            max_steps=2,
            precision="bf16-mixed",
            callbacks=[rec],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(UserModule(0.0), _data())
        return rec, trainer

    ref, _ = fit(SingleDeviceStrategy("cpu"))
    got, trainer = fit(PorosStrategy(block_size=1))
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"
    _assert_equal(ref, got)


def _host_state_step(model: torch.nn.Module, opt: torch.optim.Optimizer, host: object, armed: bool) -> None:
    """One training step with the optimizer state moved by ``host`` (armed: an update follows the backward)."""
    if armed:
        host.arm()
    model(torch.ones(2, model[0].in_features)).sum().backward()
    host.to_device()
    opt.step()
    host.to_host()
    opt.zero_grad(set_to_none=True)


def test_optimizer_state_copy_in_is_triggered_by_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """An armed backward starts the copy in once, when the trigger parameter's gradient is complete."""
    from poros_lightning.engine.optim_state import HostOptimizerState

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])
    params = list(model.parameters())  # layer 0 first: the backward reaches it last
    opt = torch.optim.AdamW(params, lr=0.1)
    host = HostOptimizerState(opt)
    trigger = len(params) // 4  # prefetch_at=0.25 of the optimizer's parameter order
    seen: list[list[bool]] = []
    monkeypatch.setattr(host, "prefetch", lambda: seen.append([p.grad is not None for p in params]) or True)

    def step(armed: bool) -> None:
        _host_state_step(model, opt, host, armed)

    step(armed=False)  # a micro-batch of gradient accumulation: no update follows its backward
    assert seen == []
    step(armed=True)
    (grads,) = seen
    assert grads[trigger] and not grads[trigger - 1]  # the layers before the trigger still to come
    assert host.prefetches == 1
    synced = []
    monkeypatch.setattr(host, "synchronize", lambda: synced.append(1))
    opt.state_dict()  # a checkpoint waits for the copies out
    assert synced
    host.close()
    step(armed=True)
    assert len(seen) == 1  # the trigger hook is gone


def test_optimizer_state_on_host_is_checkpointed(reference: Recorder, tmp_path) -> None:  # noqa: ANN001
    """The moments wait as views of one flat host buffer; a safetensors checkpoint still writes them."""
    from safetensors.torch import load_file

    from poros_lightning.lightning.checkpoint import _optimizer_files
    from poros_lightning.lightning.checkpoint_files import _write_tensors

    strategy = PorosStrategy(optimizer_on_host=True)
    _assert_equal(reference, _fit(strategy))
    host = next(iter(strategy.precision_plugin._host_states.values()))
    views = list(host.buffers.values())
    assert len(views) > 1 and len({v.untyped_storage().data_ptr() for v in views}) == 1  # one flat buffer
    tensors, _ = _optimizer_files(host.optimizer)
    _write_tensors(tmp_path / "optimizer.safetensors", tensors)
    loaded = load_file(str(tmp_path / "optimizer.safetensors"))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], t) for k, t in tensors.items())


def test_optimizer_state_loaded_into_the_optimizer_moves_to_host_again() -> None:
    """load_state_dict replaces the state dicts: the next copy out lays them out anew (none stays behind)."""
    from poros_lightning.engine.optim_state import HostOptimizerState

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    host = HostOptimizerState(opt)

    def step() -> None:
        _host_state_step(model, opt, host, armed=True)

    step()
    saved = opt.state_dict()
    opt.load_state_dict({"state": {k: {n: v.clone() for n, v in s.items()} for k, s in saved["state"].items()},
                         "param_groups": saved["param_groups"]})  # fmt: skip
    step()
    for p, state in opt.state.items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert state[name] is host.buffers[(id(p), name)]
