"""Resident-vs-streamed parity gate: the same run twice, compared with ``torch.equal``.

Reference arm: plain PEFT on a resident bitsandbytes model under Lightning's
``SingleDeviceStrategy`` (no engine code). Streamed arm: the same module under ``PorosStrategy``.
Surfaces: per-step loss and total gradient norm, and at the end every adapter tensor and every
optimizer state tensor.
"""

from __future__ import annotations

import gc
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from poros_lightning.engine.microbatch import micro_batch_mean, micro_batch_sizes, micro_batches_of
from poros_lightning.quant.hf_config import text_config
from poros_lightning.quant.loader import load_report
from poros_lightning.tools.parity.build import build_peft_model
from poros_lightning.training.compiling import compile_layers

__all__ = ["ParityModule", "ParityResult", "Recorder", "compare", "run_arm", "run_parity"]

SURFACES = ("loss", "grad_norm", "adapter", "optimizer")


def token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``ids`` under ``logits``, in float32."""
    vocab = logits.shape[-1]
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), ids[:, 1:].reshape(-1))


class ParityModule(L.LightningModule):
    """Causal-LM loss on token batches over a PEFT model built by ``build``."""

    def __init__(self, build: Callable[[], torch.nn.Module], lr: float = 1e-3) -> None:
        super().__init__()
        self.net = build()
        self.lr = lr

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(input_ids=batch, use_cache=False).logits
        k = micro_batches_of(self.net)
        if k > 1:  # block-major: one loss per micro-batch, each divided by k as accumulation does
            total, terms = micro_batch_mean(token_loss, k, logits, batch, sizes=micro_batch_sizes(self.net, len(batch)))
            self.micro_losses = [t.detach() for t in terms]
            return total
        return token_loss(logits, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class Recorder(L.Callback):
    """Records the parity surfaces on the CPU."""

    def __init__(self) -> None:
        self.loss: list[torch.Tensor] = []
        self.grad_norm: list[torch.Tensor] = []
        self.adapter: dict[str, torch.Tensor] = {}
        self.optimizer: dict[str, torch.Tensor] = {}
        self.seconds: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, idx: int):
        micro = getattr(module, "micro_losses", None)  # block-major: the k micro-batch losses, as accumulation logs
        if micro:
            self.loss.extend(t.cpu() for t in micro)
        else:
            self.loss.append(outputs["loss"].detach().cpu())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._t)

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
        self.grad_norm.append(torch.stack(norms).norm().cpu())

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        names = {id(p): n for n, p in module.named_parameters()}
        params = [p for p in module.parameters() if p.requires_grad]
        self.adapter = {names[id(p)]: p.detach().cpu().clone() for p in params}
        opt = trainer.optimizers[0]
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    if torch.is_tensor(value):
                        self.optimizer[f"{names[id(p)]}.{key}"] = value.detach().cpu().clone()


@dataclass
class ParityResult:
    """Outcome of a gate: which surfaces are equal, and the first mismatch."""

    surfaces: dict[str, bool]
    first_mismatch: str | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return all(self.surfaces.values())


def token_batches(vocab: int, seq_len: int, batch_size: int, n: int, seed: int = 1234) -> DataLoader:
    """``n`` fixed batches of random tokens (the same in both arms)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (n * batch_size, seq_len), generator=gen)
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def run_arm(
    strategy: Any,
    build: Callable[[], torch.nn.Module],
    data: DataLoader,
    *,
    steps: int,
    accumulate: int = 1,
    accelerator: str = "auto",
    compile: bool = False,
    lr: float = 1e-3,
    callbacks: list[L.Callback] | None = None,
) -> Recorder:
    """Train ``steps`` optimizer steps with ``strategy`` and record the surfaces."""
    module = ParityModule(build, lr=lr)
    L.seed_everything(0, verbose=False)  # after the build: both arms start training from the same RNG state
    if compile:
        compile_layers(module.net)
    rec = Recorder()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[rec, *(callbacks or [])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, data)
    del trainer, module
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


def compare(ref: Recorder, got: Recorder) -> ParityResult:
    """Compare every surface with ``torch.equal``; rows hold one line per (step, surface)."""
    rows: list[dict[str, Any]] = []
    first: str | None = None

    def note(step: int | None, surface: str, name: str | None, equal: bool, a: Any = None, b: Any = None) -> None:
        nonlocal first
        row = {"step": step, "surface": surface, "tensor": name, "equal": equal}
        if a is not None and a.numel() == 1:
            row["reference"], row["streamed"] = float(a), float(b)
        rows.append(row)
        if not equal and first is None:
            first = f"step {step}, surface {surface}" + (f", tensor {name}" if name else "")

    surfaces = dict.fromkeys(SURFACES, True)
    for surface, a_list, b_list in (("loss", ref.loss, got.loss), ("grad_norm", ref.grad_norm, got.grad_norm)):
        if len(a_list) != len(b_list):
            surfaces[surface] = False
            note(None, surface, None, False)
        for step, (a, b) in enumerate(zip(a_list, b_list, strict=False)):
            eq = torch.equal(a, b)
            surfaces[surface] &= eq
            note(step, surface, None, eq, a, b)
    for surface, a_map, b_map in (("adapter", ref.adapter, got.adapter), ("optimizer", ref.optimizer, got.optimizer)):
        if a_map.keys() != b_map.keys() or not a_map:
            surfaces[surface] = False
            note(None, surface, "<tensor names differ>", False)
            continue
        bad = [k for k in a_map if not torch.equal(a_map[k], b_map[k])]
        surfaces[surface] = not bad
        for k in bad[:20]:
            note(None, surface, k, False)
        rows.append({"step": "final", "surface": surface, "tensors": len(a_map), "unequal": len(bad)})
        if bad and first is None:
            first = f"final, surface {surface}, tensor {bad[0]}"
    return ParityResult(surfaces, first, rows)


def versions() -> dict[str, str]:
    import lightning
    import peft
    import transformers

    try:
        import bitsandbytes

        bnb = bitsandbytes.__version__
    except ImportError:
        bnb = "missing"
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "lightning": lightning.__version__,
        "bitsandbytes": bnb,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()})",
    }


def run_parity(
    config: dict[str, Any],
    *,
    model: str,
    scale: str,
    steps: int,
    mode: str = "plain",
    block_size: int = 1,
    seq_len: int = 512,
    batch_size: int = 1,
    lora_r: int = 16,
    lora_dropout: float | None = None,
    accumulate: int | None = None,
    out: str | Path | None = None,
    prefetch: int = 1,
    blockwise: bool | None = None,
) -> ParityResult:
    """Run both arms of a gate and (optionally) append the JSONL rows and summary to ``out``.

    ``mode``: ``"plain"`` (no dropout), ``"dropout"`` (LoRA dropout 0.1), ``"accum"`` (gradient
    accumulation 2 with dropout), ``"block_major"`` (the reference accumulates 3 micro-batches; the
    streamed arm runs them block-major, ``PorosStrategy(micro_batches=3)``), ``"block_major_dropout"`` (LoRA
    dropout 0.1; the reference accumulates 4 micro-batches, the streamed arm runs them block-major with the
    dropout draws replayed on CUDA, Note: [dropout in block-major order] in :mod:`poros_lightning.engine.microbatch`), ``"compile"`` (each decoder layer under ``torch.compile`` in both arms; Note: [compile mode] in
    :mod:`poros_lightning.training.compiling`), ``"min_memory"`` (LoRA dropout 0.1; the streamed arm keeps the
    input embeddings, the LM head's weight, the layers' saved inputs and the optimizer moments in host memory;
    :data:`MIN_MEMORY`), ``"keep_activations"`` (LoRA
    dropout 0.1; the streamed arm's layers keep their activations instead of recomputing them),
    ``"resident_blocks"`` (LoRA dropout 0.1; a quarter of the streamed arm's blocks stay on the device, spread
    between streamed ones, Note: [resident blocks] in :mod:`poros_lightning.engine.slots`), ``"replan"`` (LoRA
    dropout 0.1; the streamed arm's plan changes before every step, kept activations and resident blocks both, as
    the tuner changes it: :class:`Replan`). ``blockwise``:
    see :func:`~poros_lightning.tools.parity.build.build_peft_model` (``None``: when bf16 would not fit).
    """
    from poros_lightning.lightning.strategy import PorosStrategy

    dropout = (
        lora_dropout
        if lora_dropout is not None
        else (
            0.1
            if mode
            in (
                "dropout",
                "accum",
                "min_memory",
                "keep_activations",
                "resident_blocks",
                "block_major_dropout",
                "replan",
            )
            else 0.0
        )
    )
    default_accum = {"accum": 2, "block_major": 3, "block_major_dropout": 4}
    accum = accumulate if accumulate is not None else default_accum.get(mode, 1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.use_deterministic_algorithms(True)

    # One model serves both arms: the reference trains it resident, then its adapter is reset to the
    # initial values and the streamed arm trains it again. The base bytes are the same by construction.
    cache: dict[str, Any] = {}
    built: dict[str, str] = {}

    def build() -> torch.nn.Module:
        if "net" not in cache:
            net = build_peft_model(config, device=device, lora_r=lora_r, lora_dropout=dropout, blockwise=blockwise)
            built["how"] = "blockwise" if load_report(net.get_base_model()) is not None else "direct"
            cache["net"] = net
            cache["init"] = {n: p.detach().cpu().clone() for n, p in net.named_parameters() if p.requires_grad}
            return net
        net = cache["net"]
        with torch.no_grad():
            for n, p in net.named_parameters():
                if p.requires_grad:
                    p.data = cache["init"][n].to(device)
                    p.grad = None
        return net

    data = token_batches(int(text_config(config)["vocab_size"]), seq_len, batch_size, steps * accum)
    block_major = mode.startswith("block_major")  # streamed arm: one batch of accum micro-batches, split block-major
    streamed_data = DataLoader(data.dataset, batch_size=batch_size * accum, shuffle=False) if block_major else data
    from lightning.pytorch.strategies import SingleDeviceStrategy

    t0 = time.perf_counter()
    ref = run_arm(SingleDeviceStrategy(device), build, data, steps=steps, accumulate=accum, compile=mode == "compile")
    t1 = time.perf_counter()
    got = run_arm(
        PorosStrategy(  # the gate runs the options it names, not a plan for the card
            vram_budget="off",
            block_size=block_size,
            prefetch=prefetch,
            micro_batches=accum if block_major else 1,
            **(MIN_MEMORY if mode == "min_memory" else {}),
            **({"keep_activations": _num_layers(config)} if mode == "keep_activations" else {}),
            **({"resident_blocks": -(-_num_layers(config) // block_size) // 4} if mode == "resident_blocks" else {}),
        ),
        build,
        streamed_data,
        steps=steps,
        accumulate=1 if block_major else accum,
        compile=mode == "compile",
        callbacks=[Replan(_num_layers(config), -(-_num_layers(config) // block_size))] if mode == "replan" else None,
    )
    cache.clear()
    t2 = time.perf_counter()
    result = compare(ref, got)
    result.seconds = {"reference": t1 - t0, "streamed": t2 - t1}
    if out is not None:
        summary = {
            "summary": True,
            "model": model,
            "scale": scale,
            "steps": steps,
            "mode": mode,
            "block_size": block_size,
            "seq_len": seq_len,
            "lora_r": lora_r,
            "lora_dropout": dropout,
            "accumulate": accum,
            "build": built.get("how"),
            "model_type": config["model_type"],
            **({"sliding_window": window} if (window := text_config(config).get("sliding_window")) else {}),
            "surfaces": result.surfaces,
            "equal": result.equal,
            "first_mismatch": result.first_mismatch,
            "seconds": result.seconds,
            **versions(),
        }
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for row in result.rows:
                f.write(json.dumps({"model": model, "mode": mode, "block_size": block_size, **row}) + "\n")
            f.write(json.dumps(summary) + "\n")
    return result


class Replan(L.Callback):
    """Before each step, sets the streamed arm's kept layers and resident blocks to the next plan of a cycle:
    none, half the layers and a quarter of the blocks, every layer, half the blocks, a quarter of the layers and
    every block but two (Note: [measured plans] in :mod:`poros_lightning.engine.tuner`)."""

    def __init__(self, num_layers: int, num_blocks: int) -> None:
        n, b = num_layers, num_blocks
        self.plans = [(0, 0), (n // 2, b // 4), (n, 0), (0, b // 2), (n // 4, max(b - 2, 0))]
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        from poros_lightning.api import engine_of

        engine = engine_of(module.net)
        keep, resident = self.plans[batch_idx % len(self.plans)]
        engine.set_keep_activations(keep)
        engine.set_resident_blocks(resident)
        self.seen.append((engine.options.keep_activations, engine.options.resident_blocks))


def _num_layers(config: dict[str, Any]) -> int:
    return int(text_config(config)["num_hidden_layers"])


MIN_MEMORY = {
    "embeddings_on_host": True,
    "head_on_host": True,
    "head_copies": 1,
    "inputs_on_host": True,
    "optimizer_on_host": True,
}
"""The streamed arm's options in ``min_memory`` mode: everything that can wait in host memory does (the LM
head copied in once per step, as the planner chooses it when the head fits beside the logits)."""


def as_dict(result: ParityResult) -> dict[str, Any]:
    return asdict(result)
