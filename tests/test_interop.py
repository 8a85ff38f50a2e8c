"""Standard tools on both sides of a streamed run: PEFT adapters out, plain loops and ``transformers.Trainer`` in.

- An adapter saved from a prepared (streamed) model is a standard PEFT directory: loaded with
  ``PeftModel.from_pretrained`` on an ordinary resident model it gives ``torch.equal`` logits.
- ``prepare(model)`` is one added line on an existing loop: a plain PyTorch loop and ``transformers.Trainer``
  train the same adapter, bit for bit, as without it; ``unprepare(model)`` gives back a normal model equal
  to the resident one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import build_peft_model, differences, tiny_config, train_loop

from poros_lightning import prepare, unprepare
from poros_lightning.api import engine_of, is_prepared
from poros_lightning.training.adapter import TrainingInfo, save_adapter

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(9))


def _resident_base(seed: int = 0) -> torch.nn.Module:
    """The quantized base ``build_peft_model(seed=seed)`` wraps, built the ordinary way, without LoRA."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from poros_lightning.quant import quantize_model

    cfg = tiny_config()
    model_type = cfg.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.bfloat16)
    return quantize_model(model, "nf4-dq")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}


def test_streamed_adapter_loads_with_peft_on_a_resident_model(tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu")
    train_loop(model)
    save_adapter(model, tmp_path / "adapter")  # while prepared: PeftModel.save_pretrained + poros_training.json
    model.save_pretrained(tmp_path / "plain")  # what any PEFT user would call
    trained = {n.replace(".default", ""): p for n, p in model.named_parameters() if p.requires_grad}
    for directory in ("adapter", "plain"):
        saved = load_file(str(tmp_path / directory / "adapter_model.safetensors"))
        assert saved.keys() == trained.keys()
        assert all(torch.equal(saved[k], trained[k]) for k in saved)
    assert TrainingInfo.read(tmp_path / "adapter") == TrainingInfo()  # read off the streamed 4-bit layers

    model.eval()
    with torch.no_grad():
        streamed = model(input_ids=IDS).logits
    resident = PeftModel.from_pretrained(_resident_base(), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        loaded = resident(input_ids=IDS).logits
    assert torch.equal(streamed, loaded)


def test_prepare_in_a_plain_loop_then_unprepare() -> None:
    """The loop is the caller's; prepare() is the only added line. unprepare() returns the resident model."""
    reference_model = build_peft_model(lora_dropout=0.1)
    reference = train_loop(reference_model)
    model = prepare(build_peft_model(lora_dropout=0.1), device="cpu")
    got = train_loop(model)
    assert differences(reference, got) == {"loss": 0, "grads": 0, "adapter": 0, "optim": 0}

    assert unprepare(model) is model and not is_prepared(model)
    ours, theirs = _state(model), _state(reference_model)  # base bytes, quant states and adapter
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)

    def storages(state: dict[str, torch.Tensor]) -> int:
        return len({t.untyped_storage().data_ptr() for t in state.values()})

    assert storages(ours) == storages(theirs)  # no tensor is a view into a shared slot any more
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=IDS).logits, reference_model.eval()(input_ids=IDS).logits)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 8, length: int = 16) -> None:
        self.ids = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_run(output_dir: Path, use_prepare: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    from transformers import Trainer, TrainingArguments

    model = build_peft_model(lora_dropout=0.1)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if use_prepare:
        prepare(model, device="cpu")  # the one added line
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        seed=7,
        use_cpu=True,
        dataloader_num_workers=0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    loss = trainer.train().training_loss
    assert trainer.model is model
    if use_prepare:
        assert engine_of(model).ring.loads >= 3 * 4  # the Trainer's steps really streamed the 4 layers
        unprepare(model)
    return initial, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, loss


def test_prepare_under_transformers_trainer(tmp_path: Path) -> None:
    initial, resident, resident_loss = _trainer_run(tmp_path / "resident", use_prepare=False)
    _, streamed, streamed_loss = _trainer_run(tmp_path / "streamed", use_prepare=True)
    assert streamed.keys() == resident.keys() and len(resident) == 56
    assert [k for k in resident if not torch.equal(resident[k], streamed[k])] == []
    assert streamed_loss == resident_loss
    assert all(not torch.equal(initial[k], resident[k]) for k in resident if ".lora_B." in k)  # it did train
