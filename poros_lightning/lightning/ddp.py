"""PorosDDPStrategy: data-parallel streaming over Lightning's DDP, bit-identical to one process accumulating.

Invariant: N ranks with micro-batch ``b`` end every optimizer step with the gradients that ONE process
gets by accumulating the same N micro-batches in the same order (``accumulate_grad_batches=N``), bit
for bit; so the loss, the gradient norm, the adapter and the optimizer state are ``torch.equal``.

Note: [no DistributedDataParallel]
    DDP's reducer hooks fire per parameter during the backward, which here is a recompute-laden walk of
    streamed blocks, and it sums in bucket order with an all-reduce whose order the backend picks.
    The module stays unwrapped; gradients are combined once per backward by :func:`gather_sum_gradients`.

Note: [the gather-sum]
    One process accumulating micro-batches ``0..N-1`` backpropagates ``loss_k / N`` (Lightning divides
    by ``accumulate_grad_batches``) and adds each result into ``p.grad`` in micro-batch order. Rank
    ``k`` divides its loss by N with the same op (:meth:`PorosDDPStrategy.training_step`), so its
    backward yields exactly the single process's term ``k``; the ranks all-gather their terms (a
    gather copies, it does not add) and every rank adds them in rank order onto what ``p.grad`` held:
    the same additions, in the same order, in the same dtype. No all-reduce, whose summation order
    the backend chooses, is involved. With ``accumulate_grad_batches=k`` on top, each of the ``k``
    backward passes is gathered and folded the same way, which equals one process accumulating
    ``N * k`` when ``N`` or ``k`` is a power of two (then ``(x / N) / k == x / (N * k)`` exactly).

Note: [micro-batch order]
    Rank ``r``'s ``i``-th micro-batch must be the single process's micro-batch ``i * N + r``.
    Lightning's ``DistributedSampler`` deals out samples, not micro-batches (rank ``r`` gets samples
    ``r, r + N, ...``), so for ``b > 1`` it regroups them. :class:`MicroBatchSampler` deals out whole
    micro-batches; the strategy swaps it in for the sampler Lightning injects.

Note: [one base per host]
    Local rank 0 writes each block's host arena into a file under ``/dev/shm``; after a barrier the
    other ranks of the host map the same files (every rank built the same model, so they skip the
    copy) and each pins its mapping in place. Once all ranks have mapped them the files are unlinked:
    the memory lives as long as a mapping does, and after setup nothing can be left in ``/dev/shm``.
"""

from __future__ import annotations

import logging
import secrets
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from poros_lightning import quant
from poros_lightning.api import engine_of, is_prepared, prepare, unprepare
from poros_lightning.engine import move_resident
from poros_lightning.engine.microbatch import dropout_sources
from poros_lightning.errors import PorosConfigError
from poros_lightning.lightning.collector import FrozenSetup
from poros_lightning.lightning.ddp_shared import (
    SHM,
    MicroBatchSampler,
    SharedArenas,
    gather_sum_gradients,
)
from poros_lightning.lightning.precision import find_peft_models
from poros_lightning.lightning.strategy import PorosStrategy

__all__ = ["MicroBatchSampler", "PorosDDPStrategy", "SharedArenas", "gather_sum_gradients"]

log = logging.getLogger(__name__)


def _scale_loss(output: Any, world: int) -> Any:
    if isinstance(output, torch.Tensor):
        return output / world
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return {**output, "loss": output["loss"] / world}
    return output


class PorosDDPStrategy(DDPStrategy):
    """Data-parallel training with the frozen base streamed from host memory on every rank.

    Each rank streams the base from a host store that the ranks of one host share (one copy per
    host); only the adapter gradients travel between ranks, gathered and added in rank order after
    each backward. N ranks then train bit for bit like one process with ``accumulate_grad_batches=N``
    over the same samples (see ``docs/multi-gpu.md``), provided nothing draws random numbers in the
    forward (LoRA dropout 0).

    Args:
        block_size: decoder layers per streamed block.
        prefetch: blocks copied ahead of the one computing.
        num_slots: device slots (default ``prefetch + 1``).
        quantization: base quantization applied when the module's base is not quantized yet.
        pin_memory: page-lock the host copy of the base (CUDA only).
        use_streams: copy on a side CUDA stream.
        resident_blocks: blocks kept on the device, spread over the model.
        embeddings_on_host: keep the input embedding table in host memory (per rank, not shared).
        vram_budget: ``"auto"`` (default), a per-GPU size, or ``"off"``: each rank plans the engine options
            left ``None`` for its device, as :class:`~poros_lightning.PorosStrategy` does.
        tune_steps: early steps each rank measures to fit its plan (Note: [measured plans]).
        seq_len: sequence length the budget is planned for.
        allow_unlisted_arch: stream an architecture missing from the registry, as experimental.
        shared_base: one copy of the base per host in ``/dev/shm`` (default); ``False`` gives every
            rank its own host store.
        head_on_host: keep the LM head's weight in host memory (per rank), copied in for the head's
            forward and backward only (exact; untied models).
        head_copies: with ``head_on_host``, ``1`` keeps the forward's copy for the backward (one per step).
        head_prefetch: with ``head_on_host``, ``False`` copies the head in when it runs, not during the
            last layers' forwards.
        inputs_on_host: each recomputing layer's saved input waits in host memory (per rank; see
            :class:`~poros_lightning.PorosStrategy`).
        micro_batch_order: replace the ``DistributedSampler`` Lightning injects with a
            :class:`MicroBatchSampler` (rank ``r`` gets micro-batches ``r, r + N, ...``).
        keep_activations: the last decoder layers that keep their activations instead of recomputing
            them (see :class:`~poros_lightning.PorosStrategy`).
        allow_dropout: train with dropout anyway; ranks then draw different masks than one process
            would, so the run is not bitwise equal to single-process accumulation.
        process_group_backend: ``"nccl"`` (CUDA) or ``"gloo"`` (CPU); Lightning's default otherwise.
        timeout: collective timeout.
        start_method: how Lightning starts the other ranks (``"popen"`` re-runs the script).
        gc_freeze: each rank freezes Python's collector at the start of training (see
            :class:`~poros_lightning.PorosStrategy`).
    """

    strategy_name = "poros_ddp"

    def __init__(
        self,
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
        shared_base: bool = True,
        head_on_host: bool | None = None,
        head_copies: int | None = None,
        head_prefetch: bool | None = None,
        inputs_on_host: bool | None = None,
        micro_batch_order: bool = True,
        allow_dropout: bool = False,
        keep_activations: int | None = None,
        tune_steps: int = 8,
        gc_freeze: bool = True,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        self.quantization = quant.check_quantization(quantization)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
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
        )
        self.allow_unlisted_arch = allow_unlisted_arch
        self.micro_batches = 1
        self.optimizer_on_host = False
        self.shared_base = shared_base
        self.micro_batch_order = micro_batch_order
        self.allow_dropout = allow_dropout
        self.shared: list[SharedArenas] = []  # this rank's shared-memory factories, one per PEFT model
        self.collector = FrozenSetup(gc_freeze)

    # The same meaning as on PorosStrategy, on every rank.
    precision_plugin = PorosStrategy.precision_plugin
    _convert_precision = PorosStrategy._convert_precision
    _set_engine_options = PorosStrategy._set_engine_options
    _peft_models = PorosStrategy._peft_models
    _plan = PorosStrategy._plan
    _tune = PorosStrategy._tune
    _stop_tuning = PorosStrategy._stop_tuning
    engine_kwargs = PorosStrategy.engine_kwargs
    on_train_batch_start = PorosStrategy.on_train_batch_start
    on_train_start = PorosStrategy.on_train_start
    on_train_end = PorosStrategy.on_train_end
    lightning_module_state_dict = PorosStrategy.lightning_module_state_dict
    load_model_state_dict = PorosStrategy.load_model_state_dict

    @override
    def setup(self, trainer: Any) -> None:
        assert self.lightning_module is not None
        if self.world_size > 1:
            self._check_exact(self.lightning_module)
        # DDPStrategy.setup wraps the module in DistributedDataParallel when fitting and otherwise
        # broadcasts every tensor, the streamed ones included; the plain sequence of Strategy.setup
        # (convert, model_to_device, optimizers) is what a streamed module needs.
        super(DDPStrategy, self).setup(trainer)

    def _check_exact(self, module: nn.Module) -> None:
        if not module.automatic_optimization:
            raise PorosConfigError(
                "PorosDDPStrategy supports automatic optimization only: it scales each rank's loss by "
                "1/world_size in training_step, which a manual backward does not see.",
                "Use automatic optimization, or PorosStrategy on one device for manual optimization.",
            )
        sources = dropout_sources(module)
        if sources and not self.allow_dropout:
            raise PorosConfigError(
                f"Dropout is active ({', '.join(sources[:3])}{', ...' if len(sources) > 3 else ''}): {self.world_size} "
                "ranks draw their masks from separate RNG streams while one process accumulating draws them from "
                "one, so the data-parallel run cannot be bitwise equal to single-process accumulation.",
                "Set lora_dropout=0 (and the model's dropout to 0) for data-parallel runs, or train on one device "
                f"with PorosStrategy and accumulate_grad_batches={self.world_size} (exact with dropout), or pass "
                "PorosDDPStrategy(allow_dropout=True) to accept a non-bitwise-reproducible run.",
            )

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model  # Note: [no DistributedDataParallel]

    @override
    def configure_ddp(self) -> None:
        pass  # Note: [no DistributedDataParallel]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        device = self.root_device
        models = [m for m in self._peft_models() if not is_prepared(m)]
        plans = [self._plan(m) for m in models]
        if self.shared_base and self.world_size > 1 and models:
            self._prepare_shared(models, plans)
        else:
            for model, plan in zip(models, plans, strict=True):
                prepare(model, device=device, **plan)
                self._tune(model)
        move_resident(self.model, device)
        for module in self.model.modules():
            if hasattr(module, "_device"):
                module._device = device  # Lightning's and torchmetrics' device bookkeeping
        self._sync_resident()

    def _prepare_shared(self, models: list[nn.Module], plans: list[dict[str, Any]]) -> None:
        """Note: [one base per host]."""
        if not SHM.is_dir():
            raise PorosConfigError(
                f"{SHM} does not exist, so the ranks of a host cannot share one copy of the base.",
                "Pass PorosDDPStrategy(shared_base=False): every rank then holds its own copy.",
            )
        run = self.broadcast(secrets.token_hex(8))
        creator = self.local_rank == 0
        self.shared = [SharedArenas(SHM / f"poros-{run}-m{i}", create=creator) for i in range(len(models))]
        try:
            for creating in (True, False):  # creators fill the files; then the others map them
                if creator is creating:
                    for model, plan, arenas in zip(models, plans, self.shared, strict=True):
                        prepare(model, device=self.root_device, arena_factory=arenas, **plan)
                        self._tune(model)
                self.barrier("poros_shared_base")
        finally:
            for arenas in self.shared:
                arenas.unlink()  # every rank has mapped them (or setup failed): no file outlives the run
        if creator:
            total = sum(engine.store.total_bytes for m in models if (engine := engine_of(m)) is not None)
            log.info("poros: node %d shares one %.2f GiB copy of the base in %s", self.node_rank, total / 2**30, SHM)

    @torch.no_grad()
    def _sync_resident(self) -> None:
        """Broadcast rank 0's resident tensors (adapters, norms, embeddings, head) as DDP would at wrap time."""
        if self.world_size == 1:
            return
        assert self.model is not None
        streamed: set[int] = set()
        for peft_model in find_peft_models(self.model):
            engine = engine_of(peft_model)
            if engine is not None:
                streamed |= {id(getattr(e.owner, e.attr)) for lay in engine.store.layouts for e in lay.entries}
        tensors = [*self.model.parameters(), *self.model.buffers()]
        for t in tensors:
            if id(t) in streamed or t.device != self.root_device:
                continue
            data = t.data if t.is_contiguous() else t.data.contiguous()
            dist.broadcast(data, src=0)
            if data is not t.data:
                t.data.copy_(data)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Scale the loss by 1/world_size with the op Lightning's accumulation uses. Note: [the gather-sum]."""
        output = super().training_step(*args, **kwargs)
        return _scale_loss(output, self.world_size) if self.world_size > 1 else output

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Backward on this rank's micro-batch, then the gather-sum in rank order. Note: [the gather-sum]."""
        if self.world_size == 1:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self.lightning_module is not None
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        gather_sum_gradients(params, held)
        return closure_loss

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Swap Lightning's ``DistributedSampler`` for a :class:`MicroBatchSampler` (Note: [micro-batch order])."""
        if not (self.micro_batch_order and isinstance(dataloader, DataLoader)):
            return dataloader
        sampler = dataloader.sampler
        if type(sampler) is not DistributedSampler:
            return dataloader
        if dataloader.batch_size is None:
            rank_zero_warn(
                "PorosDDPStrategy keeps Lightning's DistributedSampler for a DataLoader with a custom batch_sampler: "
                "ranks get interleaved samples, not the micro-batches one process would see in order."
            )
            return dataloader
        micro = MicroBatchSampler(
            sampler.dataset,
            dataloader.batch_size,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
        )
        return _update_dataloader(dataloader, micro)

    @override
    def teardown(self) -> None:
        # The base becomes views into the host arenas (no copy): with a shared base, N copies of it at
        # teardown could exhaust host RAM. Lightning's teardown then moves the module to the CPU (a no-op).
        self.collector.thaw()
        self._stop_tuning()
        if self.model is not None:
            for peft_model in find_peft_models(self.model):
                if is_prepared(peft_model):
                    unprepare(peft_model, device="cpu", copy=False)
        for arenas in self.shared:
            arenas.unlink()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0])
