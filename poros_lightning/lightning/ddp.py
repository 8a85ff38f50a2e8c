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
import math
import os
import secrets
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from poros_lightning import quant
from poros_lightning.api import engine_of, is_prepared, prepare, unprepare
from poros_lightning.engine import move_resident
from poros_lightning.engine.microbatch import dropout_sources
from poros_lightning.errors import PorosConfigError, PorosOOMError
from poros_lightning.lightning.precision import find_peft_models
from poros_lightning.lightning.strategy import PorosStrategy

__all__ = ["MicroBatchSampler", "PorosDDPStrategy", "SharedArenas", "gather_sum_gradients"]

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")



class MicroBatchSampler(DistributedSampler):
    """Deals out whole micro-batches: rank ``r``'s ``i``-th batch is global micro-batch ``i * N + r``.

    The global sample order is ``0..n-1``, or with ``shuffle`` the permutation ``DistributedSampler``
    draws (seeded by ``seed + epoch``); ``num_replicas=1`` gives that same order to a single process.
    The order is padded by wrapping around (or, with ``drop_last``, cut) to whole rounds of
    ``num_replicas`` micro-batches, so every rank runs the same number of steps.

    Args:
        dataset: a map-style dataset.
        batch_size: the DataLoader's micro-batch size ``b``.
        num_replicas: number of ranks (default: the process group's size).
        rank: this rank (default: the process group's rank).
        shuffle: permute the samples each epoch.
        seed: permutation seed (the same on every rank).
        drop_last: drop the tail that does not fill a whole round instead of padding it.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        if batch_size < 1:
            raise PorosConfigError(f"batch_size must be >= 1, got {batch_size}.", "Pass the DataLoader's batch_size.")
        self.batch_size = batch_size
        round_size = batch_size * self.num_replicas
        rounds = len(dataset) // round_size if drop_last else math.ceil(len(dataset) / round_size)  # type: ignore[arg-type]
        self.total_size = rounds * round_size
        self.num_samples = rounds * batch_size

    @override
    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=gen).tolist()
        else:
            order = list(range(n))
        while len(order) < self.total_size:  # wrap around, as DistributedSampler pads
            order += order[: self.total_size - len(order)]
        b, world = self.batch_size, self.num_replicas
        for i in range(self.num_samples // b):
            start = (i * world + self.rank) * b
            yield from order[start : start + b]


class SharedArenas:
    """An arena factory (see :data:`~poros_lightning.engine.store.ArenaFactory`) backed by files in shared memory.

    The creator makes ``{prefix}-{block}`` files of exactly the block's size (reserved up front, so a
    full ``/dev/shm`` fails here with a clear error instead of a SIGBUS later) and lets the store copy
    the block into them; the others map the files the creator filled and report them filled.

    Args:
        prefix: path prefix of the files, unique per run and model.
        create: create and fill the files (local rank 0) or map the existing ones.
    """

    def __init__(self, prefix: Path, create: bool) -> None:
        self.prefix = prefix
        self.create = create
        self.paths: list[Path] = []

    def __call__(self, block: int, nbytes: int) -> tuple[torch.Tensor, bool]:
        path = Path(f"{self.prefix}-{block:05d}")
        if self.create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self.paths.append(path)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as err:
                raise PorosOOMError(
                    f"Cannot reserve {nbytes / 2**20:.1f} MiB in {path.parent} for block {block} of the shared base "
                    f"({err.strerror}).",
                    "Enlarge the shared-memory mount (Docker: --shm-size; see `df -h /dev/shm`), or pass "
                    "PorosDDPStrategy(shared_base=False) to give every rank its own copy of the base.",
                ) from err
            finally:
                os.close(fd)
        else:
            size = path.stat().st_size if path.exists() else None
            if size != nbytes:
                raise PorosConfigError(
                    f"Block {block} of the shared base should be {nbytes} bytes in {path}, found "
                    f"{'no file' if size is None else f'{size} bytes'}: the ranks of this host built different models.",
                    "Build the model identically on every rank (same checkpoint and quantization; seed before a "
                    "random init), or pass PorosDDPStrategy(shared_base=False).",
                )
        arena = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        return arena, not self.create

    def unlink(self) -> None:
        """Remove the files; mappings stay valid until the last one goes."""
        for path in self.paths:
            path.unlink(missing_ok=True)
        self.paths = []


@torch.no_grad()
def gather_sum_gradients(params: list[nn.Parameter], held: list[torch.Tensor | None], group: Any = None) -> None:
    """Set each ``p.grad`` to ``held`` plus every rank's ``p.grad``, added in rank order, on every rank.

    This is what ``p.grad`` holds in one process that runs rank 0's backward, then rank 1's, ...: the
    first term is stored (or added onto ``held``), each next one added in place, in ``p``'s dtype.

    Args:
        params: the trainable parameters, in the same order on every rank.
        held: what each ``p.grad`` held before this backward (``None`` after ``zero_grad``).
        group: the process group (default: the world).
    """
    world = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        sizes = [params[i].numel() for i in idx]
        total = sum(sizes)
        # One flat buffer per dtype: the gradients, then one presence flag per tensor (a rank may not
        # have touched a parameter); flags of 0/1 are exact in any floating dtype.
        flat = torch.zeros(total + len(idx), dtype=dtype, device=params[idx[0]].device)
        offset = 0
        for k, (i, n) in enumerate(zip(idx, sizes, strict=True)):
            grad = params[i].grad
            if grad is not None:
                flat[offset : offset + n].copy_(grad.reshape(-1))
                flat[total + k] = 1
            offset += n
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat, group=group)
        present = torch.stack([g[total:] for g in gathered]).cpu() != 0  # [rank, tensor]
        held_here = [held[i] for i in idx]
        if bool(present.all()) and (all(h is None for h in held_here) or all(h is not None for h in held_here)):
            acc = torch.cat([h.reshape(-1) for h in held_here]) if held_here[0] is not None else None
            for part in gathered:
                acc = part[:total] if acc is None else acc.add_(part[:total])
            offset = 0
            for i, n in zip(idx, sizes, strict=True):
                params[i].grad = acc[offset : offset + n].view_as(params[i])
                offset += n
            continue
        offset = 0
        for k, (i, n) in enumerate(zip(idx, sizes, strict=True)):
            grad = held_here[k]
            for rank in range(world):
                if present[rank, k]:
                    term = gathered[rank][offset : offset + n].view_as(params[i])
                    grad = term.clone() if grad is None else grad.add_(term)
            params[i].grad = grad
            offset += n


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
        vram_budget: a per-GPU memory budget the planner fits ``resident_blocks``,
            ``embeddings_on_host`` and ``head_on_host`` to (see :class:`~poros_lightning.PorosStrategy`).
        seq_len: sequence length the budget is planned for.
        allow_unlisted_arch: stream an architecture missing from the registry, as experimental.
        shared_base: one copy of the base per host in ``/dev/shm`` (default); ``False`` gives every
            rank its own host store.
        head_on_host: keep the LM head's weight in host memory (per rank), copied in for the head's
            forward and backward only (exact; untied models).
        head_copies: with ``head_on_host``, ``1`` keeps the forward's copy for the backward (one per step).
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
    """

    strategy_name = "poros_ddp"

    def __init__(
        self,
        block_size: int = 1,
        prefetch: int = 1,
        num_slots: int | None = None,
        quantization: str = "nf4-dq",
        pin_memory: bool = True,
        use_streams: bool = True,
        resident_blocks: int = 0,
        embeddings_on_host: bool = False,
        vram_budget: str | int | None = None,
        seq_len: int | None = None,
        allow_unlisted_arch: bool = False,
        shared_base: bool = True,
        head_on_host: bool = False,
        head_copies: int = 2,
        inputs_on_host: bool = False,
        micro_batch_order: bool = True,
        allow_dropout: bool = False,
        keep_activations: int = 0,
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
            inputs_on_host=inputs_on_host,
            allow_unlisted_arch=allow_unlisted_arch,
        )
        self.shared_base = shared_base
        self.micro_batch_order = micro_batch_order
        self.allow_dropout = allow_dropout
        self.shared: list[SharedArenas] = []  # this rank's shared-memory factories, one per PEFT model

    # The same meaning as on PorosStrategy, on every rank.
    precision_plugin = PorosStrategy.precision_plugin
    _convert_precision = PorosStrategy._convert_precision
    _set_engine_options = PorosStrategy._set_engine_options
    _peft_models = PorosStrategy._peft_models
    _plan = PorosStrategy._plan
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
                prepare(model, device=device, **{**self.engine_kwargs, **plan})
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
                        prepare(model, device=self.root_device, arena_factory=arenas, **{**self.engine_kwargs, **plan})
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
