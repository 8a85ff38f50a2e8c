"""PorosStrategy: a single-device Lightning strategy whose frozen base streams from host memory.

A thin adapter over :func:`poros_lightning.prepare` / :func:`poros_lightning.unprepare`: ``setup``
quantizes (through :class:`PorosPrecision`) and prepares every PEFT model the LightningModule holds;
``teardown`` gives the base its own memory back, on the CPU, before Lightning moves the module.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from typing_extensions import override

from poros_lightning import quant
from poros_lightning.api import default_device, is_prepared, prepare, unprepare
from poros_lightning.engine import move_resident
from poros_lightning.errors import PorosConfigError
from poros_lightning.lightning.collector import FrozenSetup
from poros_lightning.lightning.planning import check_budget, plan_for
from poros_lightning.lightning.precision import PorosPrecision, find_peft_models
from poros_lightning.memory.options import resolve

__all__ = ["PorosStrategy"]

log = logging.getLogger(__name__)


def _to_poros_precision(
    plugin: Precision, quantization: str, optimizer_on_host: bool = False, micro_batches: int = 1
) -> PorosPrecision:
    if isinstance(plugin, PorosPrecision):
        plugin.optimizer_on_host = plugin.optimizer_on_host or optimizer_on_host
        plugin.optimizer_prefetch = plugin.optimizer_prefetch and micro_batches == 1  # Note: [when the state moves]
        return plugin
    name = type(plugin).__name__
    if name == "BitsandbytesPrecision":
        raise PorosConfigError(
            "PorosStrategy quantizes the base itself; Lightning's BitsandbytesPrecision plugin is not needed.",
            "Drop the plugin and set the mode with PorosStrategy(quantization='nf4-dq').",
        )
    flag = getattr(plugin, "precision", "32-true")
    return PorosPrecision(
        str(flag), quantization=quantization, optimizer_on_host=optimizer_on_host, optimizer_prefetch=micro_batches == 1
    )


def nondeterminism(device: torch.device) -> str | None:
    """Why training on ``device`` may not be bit-reproducible across runs (``None``: nothing known)."""
    if device.type != "cuda" or torch.are_deterministic_algorithms_enabled():
        return None
    return (
        "torch.use_deterministic_algorithms is off on CUDA: some kernels may sum in a different order on each "
        "run, so a repeated or resumed run can differ from the first in the last bits. Set trainer.deterministic: "
        "true (or call torch.use_deterministic_algorithms(True) and export CUBLAS_WORKSPACE_CONFIG=:4096:8)."
    )


class PorosStrategy(SingleDeviceStrategy):
    """Train on one device with the frozen base streamed block by block from pinned host memory.

    The adapters, optimizer state, loss and gradient norms are bit-identical to the same run with a
    fully resident model (``SingleDeviceStrategy``); see ``docs/parity.md``.

    Args:
        device: compute device; by default the accelerator's device (CUDA when available).
        block_size: decoder layers per streamed block.
        prefetch: blocks copied ahead of the one computing.
        num_slots: device slots (default ``prefetch + 1``).
        quantization: base quantization applied when the module's base is not quantized yet
            (``"nf4-dq"``, ``"nf4"``, ``"fp4"``, ``"none"``).
        pin_memory: page-lock the host copy of the base (CUDA only).
        use_streams: copy on a side CUDA stream (``False``: synchronous copies, for debugging).
        resident_blocks: blocks kept on the device, spread over the model (copied once per run instead of twice a step).
        keep_activations: the last ``keep_activations`` decoder layers keep their activations until the
            backward instead of recomputing them: exact, one layer forward fewer per step each (faster when
            the step is bound by kernel launches, short sequences), for the memory of their activations.
            A number >= the layer count keeps every layer's; ``vram_budget`` plans it.
        embeddings_on_host: keep the input embedding table in host memory (exact; untied models).
        head_on_host: keep the LM head's weight in host memory, copied in for the head's forward and
            backward only (exact; untied models; two head copies per step).
        head_copies: with ``head_on_host``, ``1`` keeps the forward's copy of the head for its backward:
            one head copy per step, the weight then beside the fp32 logits during the loss (exact).
        head_prefetch: with ``head_on_host``, ``False`` copies the head in when it runs instead of during the
            last layers' forwards: less memory beside those forwards, a copy not hidden (exact).
        inputs_on_host: each recomputing layer's saved input (its hidden state, ``tokens x hidden``) waits
            in pinned host memory from the forward to the backward, copied out and back on side streams
            (exact; what a streamed forward otherwise accumulates on the device, one per layer).
        vram_budget: ``"auto"`` (default): plan for the device's free memory at setup, less a margin
            (:func:`poros_lightning.memory.options.auto_budget`); a size (``"8GB"``, bytes): plan for that;
            ``"off"``: no plan, unset options take the engine's defaults. The planner chooses every engine
            option left ``None``; options set here win over the plan and the log says so. The first
            ``tune_steps`` steps then fit the plan to their measured peaks and times (exact; Note:
            [measured plans] in engine/tuner.py). Raises ``PorosOOMError`` naming the smallest budget that
            fits when nothing does. On the CPU there is no device budget: ``"auto"`` means ``"off"``.
        tune_steps: early steps measured to fit the plan (0: keep the estimated plan as it is).
        seq_len: sequence length the budget is planned for; by default the datamodule's ``seq_len``.
        allow_unlisted_arch: stream an architecture missing from the registry, as experimental.
        micro_batches: ``k > 1`` runs each batch as ``k`` micro-batches *block-major*: every micro-batch
            passes through a block before the next block is loaded, so the base is copied once per
            step instead of ``k`` times. Bit-identical to ``accumulate_grad_batches=k`` with batches
            ``k`` times smaller when the module computes its loss per micro-batch
            (``LoRALightningModule`` does; see :func:`poros_lightning.engine.microbatch.micro_batch_mean`)
            and nothing draws random numbers (LoRA dropout 0): dropout is refused, naming the fix.
        optimizer_on_host: keep the optimizer state (AdamW's two moments, twice the adapter's size) in
            host memory between steps; it is on the device only while the optimizer updates (exact).
        gc_freeze: at the start of training, collect once and ``gc.freeze()`` what exists, so that Python's
            full collections during training do not rescan the model; thawed when training ends. Changes no
            result (Note: [frozen setup] in lightning/collector.py).
    """

    strategy_name = "poros"

    def __init__(
        self,
        device: _DEVICE | None = None,
        block_size: int | None = None,
        prefetch: int | None = None,
        num_slots: int | None = None,
        quantization: str = "nf4-dq",
        pin_memory: bool | None = None,
        use_streams: bool | None = None,
        resident_blocks: int | None = None,
        embeddings_on_host: bool | None = None,
        vram_budget: str | int | None = "auto",
        seq_len: int | None = None,
        allow_unlisted_arch: bool = False,
        micro_batches: int = 1,
        head_on_host: bool | None = None,
        head_copies: int | None = None,
        head_prefetch: bool | None = None,
        inputs_on_host: bool | None = None,
        optimizer_on_host: bool | None = None,
        keep_activations: int | None = None,
        tune_steps: int = 8,
        gc_freeze: bool = True,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise PorosConfigError(
                f"micro_batches must be a positive integer, got {micro_batches!r}.",
                "Use micro_batches=1 (off) or k >= 2 micro-batches per batch.",
            )
        self.micro_batches = micro_batches
        self.optimizer_on_host = bool(optimizer_on_host)
        self.splitters: list[Any] = []
        self.quantization = quant.check_quantization(quantization)
        if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise PorosConfigError(
                f"PorosStrategy(device={device!r}) asks for a GPU, but this torch {torch.__version__} "
                f"{'has no CUDA support' if torch.version.cuda is None else 'sees no CUDA device'}.",
                "Install a CUDA build of torch (see https://pytorch.org/get-started/locally/) and check nvidia-smi, "
                "or train on the CPU with device='cpu' (trainer.accelerator: cpu).",
            )
        self._explicit_device = device is not None
        super().__init__(
            device=device if device is not None else default_device(),
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._set_engine_options(
            vram_budget,
            seq_len,
            tune_steps,
            block_size=block_size,
            prefetch=prefetch,
            num_slots=num_slots,
            pin_memory=pin_memory,
            use_streams=use_streams,
            resident_blocks=resident_blocks,
            keep_activations=keep_activations,
            embeddings_on_host=embeddings_on_host,
            head_on_host=head_on_host,
            head_copies=head_copies,
            head_prefetch=head_prefetch,
            inputs_on_host=inputs_on_host,
            optimizer_on_host=optimizer_on_host,
        )
        self.allow_unlisted_arch = allow_unlisted_arch
        self.collector = FrozenSetup(gc_freeze)

    def _tune(self, peft_model: nn.Module) -> None:
        """Measure the first steps and fit the plan to them (Note: [measured plans]; CUDA with a plan only)."""
        from poros_lightning.lightning.planning import tuner_for

        tuner = tuner_for(self, peft_model, log)
        if tuner is not None:
            self.tuners.append(tuner)

    def _set_engine_options(
        self, vram_budget: str | int | None, seq_len: int | None, tune_steps: int, **options: Any
    ) -> None:
        """What the user set, the budget and what the planner needs (shared with PorosDDPStrategy).

        Engine options left ``None`` are the plan's to choose (Note: [who decides] in memory/options.py).
        """
        check_budget(vram_budget)
        self.explicit: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
        self.vram_budget = vram_budget
        self.seq_len = seq_len
        self.tune_steps = tune_steps
        self.plans: list[Any] = []
        self.tuners: list[Any] = []

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        """The options ``prepare`` gets without a plan: the engine's defaults and what the user set."""
        chosen, _ = resolve(self.explicit, None)
        chosen.pop("optimizer_on_host")
        return {**chosen, "allow_unlisted_arch": self.allow_unlisted_arch}

    # Lightning's connector hands a name-registered strategy its devices through this property.
    @property
    def parallel_devices(self) -> list[torch.device]:
        return [self.root_device] if self._explicit_device else []

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices:
            device = torch.device(devices[0])
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", 0)
            self._root_device = device

    # Note: [precision flag]
    #     Lightning's connector uses a strategy instance's own ``_precision_plugin`` instead of
    #     ``Trainer(precision=...)`` when one is set. So none is stored until Lightning hands one over
    #     (built from the flag, converted to PorosPrecision here); until then the getter returns the default.
    @property
    @override
    def precision_plugin(self) -> PorosPrecision:
        if self._precision_plugin is None:
            return self._convert_precision(Precision())
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else self._convert_precision(plugin)

    def _convert_precision(self, plugin: Precision) -> PorosPrecision:
        quantization = getattr(self, "quantization", "nf4-dq")
        return _to_poros_precision(
            plugin, quantization, getattr(self, "optimizer_on_host", False), getattr(self, "micro_batches", 1)
        )

    def _peft_models(self) -> list[nn.Module]:
        assert self.model is not None
        models = find_peft_models(self.model)
        if not models:
            raise PorosConfigError(
                f"{type(self.model).__name__} holds no PEFT model, so there is no frozen base to stream.",
                "Wrap the Hugging Face model with peft.get_peft_model(...) and keep it as an attribute of the "
                "LightningModule (LoRALightningModule does this).",
            )
        return models

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        device = self.root_device
        if (why := nondeterminism(device)) is not None:
            warnings.warn(why, stacklevel=2)
        for peft_model in self._peft_models():
            if self.micro_batches > 1 and is_prepared(peft_model):
                raise PorosConfigError(
                    "PorosStrategy(micro_batches=...) splits the layers before preparing them, but this model is "
                    "already prepared.",
                    "Do not call prepare() yourself when the strategy streams the model, or use micro_batches=1.",
                )
            if not is_prepared(peft_model):
                if self.micro_batches > 1:
                    self._split_micro_batches(peft_model)  # inside the engine's wrapper: one load for all
                prepare(peft_model, device=device, **self._plan(peft_model))
                self._tune(peft_model)
        # Everything else the LightningModule holds (metrics, extra heads) is small and resident.
        move_resident(self.model, device)
        for module in self.model.modules():
            if hasattr(module, "_device"):
                module._device = device  # Lightning's and torchmetrics' device bookkeeping

    def _split_micro_batches(self, peft_model: nn.Module) -> None:
        """Install block-major micro-batches on ``peft_model`` (Note: [ordered gradient sum] in engine.microbatch)."""
        from poros_lightning.api import check_block_major, install_block_major

        k = self.micro_batches
        replay = check_block_major(
            peft_model,
            f"PorosStrategy(micro_batches={k})",
            "micro_batches=1 with Trainer(accumulate_grad_batches=k)",
            device=self.root_device,
        )
        micro_size = self._check_block_major_data(getattr(self.lightning_module, "_trainer", None))
        splitter = install_block_major(
            peft_model, k, micro_size, allow_unlisted_arch=self.allow_unlisted_arch, replay_dropout=replay
        )
        self.splitters.append(splitter)

    def _check_block_major_data(self, trainer: Any) -> int | None:
        """Refuse data whose micro-batches would not keep their own shapes; warn where scaling rounds differently.

        Returns the rows per micro-batch when the datamodule says (else the first training batch sets it).
        """
        data = getattr(trainer, "datamodule", None) if trainer is not None else None
        micro_size = None
        if data is not None and hasattr(data, "packing") and hasattr(data, "pad_to_multiple_of"):
            fixed = data.packing or (data.pad_to_multiple_of and data.pad_to_multiple_of >= data.seq_len)
            if not fixed:
                raise PorosConfigError(
                    f"PorosStrategy(micro_batches={self.micro_batches}) needs every batch padded to one length: "
                    "a batch padded to its longest row gives each micro-batch another length than it has alone.",
                    f"Set data.pad_to_multiple_of: {data.seq_len} (or data.packing: true), or use micro_batches=1.",
                )
            if data.batch_size % self.micro_batches:
                raise PorosConfigError(
                    f"data.batch_size={data.batch_size} is not a multiple of micro_batches={self.micro_batches}.",
                    f"Set data.batch_size to micro-batch size x {self.micro_batches}.",
                )
            micro_size = data.batch_size // self.micro_batches
        m = getattr(trainer, "accumulate_grad_batches", 1) if trainer is not None else 1
        one = torch.tensor(1.0)
        if m > 1 and not torch.equal(one / m / self.micro_batches, one / (m * self.micro_batches)):
            warnings.warn(
                f"micro_batches={self.micro_batches} with accumulate_grad_batches={m} scales the gradients by "
                f"(1/{m})/{self.micro_batches}, which rounds differently from 1/{m * self.micro_batches}: not "
                f"bit-identical to accumulate_grad_batches={m * self.micro_batches}. Powers of two are exact.",
                stacklevel=2,
            )
        return micro_size

    def _planned_batch(self, trainer: Any) -> int:
        """Rows the planner budgets for: 1 per step, or the whole block-major batch (validation runs it unsplit)."""
        if self.micro_batches == 1:
            return 1
        batch_size = getattr(getattr(trainer, "datamodule", None), "batch_size", None)
        return batch_size if isinstance(batch_size, int) and batch_size > 0 else self.micro_batches

    def _plan(self, peft_model: nn.Module) -> dict[str, Any]:
        """The options ``prepare`` gets for ``peft_model``: the plan for the budget, then what the user set."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        plan = plan_for(self, peft_model, trainer, log)
        if plan is None:
            return self.engine_kwargs
        self.plans.append(plan)
        options, _ = resolve(self.explicit, plan.options())
        if options.pop("optimizer_on_host"):
            self.optimizer_on_host = True
            if isinstance(self._precision_plugin, PorosPrecision):
                self._precision_plugin.optimizer_on_host = True
        return {**options, "allow_unlisted_arch": self.allow_unlisted_arch}

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Note: [measured plans] in engine/tuner.py: the first steps fit the plan to what they really use.
        for tuner in self.tuners:
            tuner.step_boundary()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The trainable tensors only (the adapter): the frozen base is never checkpointed."""
        assert self.lightning_module is not None
        return {name: p.detach() for name, p in self.lightning_module.named_parameters() if p.requires_grad}

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=False)

    @override
    def on_train_start(self) -> None:
        self.collector.freeze()  # Note: [frozen setup]

    @override
    def on_train_end(self) -> None:
        self.collector.thaw()
        self._stop_tuning()

    def _stop_tuning(self) -> None:
        """A fit shorter than ``tune_steps``, or one that raised, leaves its tuners measuring: stop them (the plan
        stays as it is), before the engines they time are unprepared."""
        for tuner in self.tuners:
            tuner.close()
        self.tuners = []

    @override
    def teardown(self) -> None:
        self.collector.thaw()  # a fit that raised ends here without on_train_end
        self._stop_tuning()
        # Give the base its own memory back on the CPU first: Lightning's teardown moves the module to
        # the CPU, which must not read the slots (they hold only the last blocks).
        if self.model is not None:
            for peft_model in find_peft_models(self.model):
                if is_prepared(peft_model):
                    unprepare(peft_model, device="cpu")
        for splitter in self.splitters:
            splitter.uninstall()
        self.splitters = []
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0])
