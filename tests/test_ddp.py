"""PorosDDPStrategy: N ranks equal one process accumulating N micro-batches, four surfaces torch.equal.

The data-parallel arm runs in two separate Python processes, this file run as a script
(``python tests/test_ddp.py cpu OUT``, one per rank, as torchrun starts them). Rank 0 writes the
surfaces, the host-memory readings and the checkpoint markers under ``OUT``; the tests compare them
with a one-process ``PorosStrategy`` run with ``accumulate_grad_batches=N`` over the same samples.

GPU gate (2 CUDA devices, NCCL; ``POROS_DDP_MODEL`` picks a known config, Qwen/Qwen2.5-7B by default),
writing ``$POROS_ARTIFACTS/validation/ddp_<model>.jsonl``:

    POROS_ARTIFACTS=docs CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0 pytest -m gpu tests/test_ddp.py

With one GPU, the NCCL smoke test runs the two ranks as two processes on that GPU. NCCL refuses two
ranks of one host on one device ("Duplicate GPU detected"), so each process is its own "node"
(``num_nodes=2``, a distinct ``NCCL_HOSTID``): NCCL then connects them over its socket transport on
the loopback interface. Each rank holds its own host copy of the base (``shared_base=False``: the
shared copy is per node, and these two nodes share a host). It writes ``ddp_<model>_one_gpu.jsonl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from conftest import build_peft_model, tiny_config
from lightning.fabric.plugins import TorchCheckpointIO
from torch.utils.data import DataLoader

import poros_lightning  # noqa: F401  (registers "poros")
from poros_lightning.api import engine_of
from poros_lightning.lightning.ddp import MicroBatchSampler, PorosDDPStrategy
from poros_lightning.lightning.strategy import PorosStrategy
from poros_lightning.tools.parity.runner import ParityModule, Recorder, compare, token_batches, versions

CFG = tiny_config(hidden_size=256, intermediate_size=512)  # 4 layers: a host store of 1.2 MB
WORLD = 2
DATA = torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(7))
# name -> (optimizer steps, accumulate_grad_batches per rank, how the ranks get their micro-batches):
#   "injected": Lightning injects its (shuffling) DistributedSampler and the strategy swaps in a MicroBatchSampler
#   "explicit": use_distributed_sampler=False and a sequential MicroBatchSampler built in train_dataloader()
#   "interleaved": micro_batch_order=False keeps Lightning's sampler (negative control)
RUNS = {"plain": (3, 1, "injected"), "accum": (2, 2, "explicit"), "interleaved": (3, 1, "interleaved")}
# the one-process arm of each: (data order, optimizer steps, accumulate_grad_batches)
REFERENCES = {"plain": ("shuffled-single", 3, WORLD), "accum": ("sequential", 2, 2 * WORLD)}


class Data(L.LightningDataModule):
    """16 sequences of 16 tokens in micro-batches of 2, dealt as ``order`` says."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.order = order

    def train_dataloader(self) -> DataLoader:
        if self.order == "explicit":  # built here: the process group exists by now
            return DataLoader(DATA, batch_size=2, sampler=MicroBatchSampler(DATA, 2, shuffle=False))
        if self.order == "shuffled-single":  # the order of "injected" on one process: seed 0, as seed_everything(0)
            return DataLoader(DATA, batch_size=2, sampler=MicroBatchSampler(DATA, 2, 1, 0, shuffle=True, seed=0))
        return DataLoader(DATA, batch_size=2, shuffle=False)


class Surfaces(Recorder):
    """The parity recorder, with every rank's per-micro-batch loss gathered in global micro-batch order."""

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_train_end(trainer, module)
        if trainer.world_size > 1:
            # rank r's i-th micro-batch is global micro-batch i * N + r: rank-minor order
            device = trainer.strategy.root_device  # NCCL gathers device tensors only
            self.loss = list(trainer.strategy.all_gather(torch.stack(self.loss).to(device)).cpu().t().reshape(-1))
            flat = torch.cat([t.reshape(-1).float() for t in self.adapter.values()]).to(device)
            gathered = trainer.strategy.all_gather(flat)
            self.ranks_equal = all(torch.equal(gathered[0], g) for g in gathered)
            self.memory = _gather_memory(trainer, module)

    def state(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("loss", "grad_norm", "adapter", "optimizer")}


def _fit(strategy: Any, order: str, *, steps: int, accumulate: int, devices: int = 1) -> Surfaces:
    L.seed_everything(0, verbose=False)
    module = ParityModule(lambda: build_peft_model(CFG, lora_dropout=0.0), lr=1e-2)
    rec = Surfaces()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[rec],
        use_distributed_sampler=order != "explicit",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=Data(order))
    rec.trainer = trainer
    return rec


# ----------------------------------------------------------------------------------------------------
# host memory: the mappings of the shared base, read from /proc


def _smaps(pattern: str = "/dev/shm/poros-") -> dict[str, int]:
    """kB of Rss, Pss, Shared and Private over this process's mappings whose path contains ``pattern``."""
    totals = dict.fromkeys(("Rss", "Pss", "Shared", "Private"), 0)
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and not fields[0].endswith(":"):  # a mapping header: address perms offset dev inode path
            inside = pattern in line
        elif inside and fields[0].rstrip(":") in ("Rss", "Pss"):
            totals[fields[0].rstrip(":")] += int(fields[1])
        elif inside and fields[0].startswith(("Shared_", "Private_")) and "Hugetlb" not in fields[0]:
            totals[fields[0].split("_")[0]] += int(fields[1])
    return totals


def _gather_memory(trainer: L.Trainer, module: L.LightningModule) -> list[dict[str, Any]]:
    import psutil
    import torch.distributed as dist

    info = psutil.Process().memory_full_info()
    engine = engine_of(module.net)
    mine = {
        "rank": trainer.global_rank,
        "store_bytes": engine.store.total_bytes if engine is not None else 0,
        "blocks": engine.num_blocks if engine is not None else 0,
        "shared_base_kB": _smaps(),
        "process": {"rss": info.rss, "pss": info.pss, "uss": info.uss},
    }
    out: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(out, mine)
    return out


class RankMarkingIO(TorchCheckpointIO):
    """Leaves ``PATH.rankR`` next to each checkpoint it writes: which ranks wrote."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        import torch.distributed as dist

        Path(f"{path}.rank{dist.get_rank()}").touch()
        super().save_checkpoint(checkpoint, path, storage_options)


def _cpu_worker(out: Path) -> None:
    """Every rank runs this (the test starts both, with the environment torchrun would set)."""
    torch.set_num_threads(1)
    for name, (steps, accumulate, order) in RUNS.items():
        io = RankMarkingIO() if name == "plain" else None
        ordered = order != "interleaved"
        # The accumulation run also keeps the embeddings and the LM head in host memory (per rank).
        host = {"embeddings_on_host": True, "head_on_host": True} if name == "accum" else {}
        strategy = PorosDDPStrategy(process_group_backend="gloo", micro_batch_order=ordered, checkpoint_io=io, **host)
        rec = _fit(strategy, order, steps=steps, accumulate=accumulate, devices=WORLD)
        if name == "plain":
            rec.trainer.save_checkpoint(out / "last.ckpt")
        if rec.trainer.is_global_zero:
            torch.save({**rec.state(), "ranks_equal": rec.ranks_equal}, out / f"{name}.pt")
            if name == "plain":
                (out / "memory.json").write_text(json.dumps(rec.memory, indent=1))


# ----------------------------------------------------------------------------------------------------
# CPU tests (gloo, 2 processes)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Surfaces]]:
    """The 2-rank runs (a subprocess) and, meanwhile, the one-process references in this process."""
    out = tmp_path_factory.mktemp("ddp")
    root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    # Start both ranks at once, as torchrun would (LOCAL_RANK set: Lightning starts no process itself).
    env.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0"}
    )
    cmd = [sys.executable, str(Path(__file__).resolve()), "cpu", str(out)]
    logs = [(out / f"rank{r}.log").open("w") for r in range(WORLD)]
    procs = [
        subprocess.Popen(cmd, env={**env, "LOCAL_RANK": str(r)}, cwd=root, stdout=log, stderr=subprocess.STDOUT)
        for r, log in enumerate(logs)
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run one thread each; CPU kernels may split work by thread count
    try:
        refs = {name: _fit(PorosStrategy(), order, steps=s, accumulate=a) for name, (order, s, a) in REFERENCES.items()}
    finally:
        torch.set_num_threads(threads)
        codes = [proc.wait(timeout=300) for proc in procs]
        for log in logs:
            log.close()
    assert codes == [0] * WORLD, "\n".join((out / f"rank{r}.log").read_text()[-4000:] for r in range(WORLD))
    return out, refs


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load(path: Path) -> SimpleNamespace:
    return SimpleNamespace(**torch.load(path, weights_only=False))


def test_two_ranks_equal_one_process_accumulating_two(ddp: tuple[Path, dict[str, Surfaces]]) -> None:
    out, refs = ddp
    got = _load(out / "plain.pt")
    result = compare(refs["plain"], got)
    assert result.equal, (result.surfaces, result.first_mismatch)
    assert len(got.loss) == 3 * WORLD and got.ranks_equal


def test_accumulation_on_top(ddp: tuple[Path, dict[str, Surfaces]]) -> None:
    """2 ranks x accumulate 2 == one process x accumulate 4: each backward is gathered and folded in order
    (the ranks keep their embeddings and LM head in host memory; the reference does not)."""
    out, refs = ddp
    got = _load(out / "accum.pt")
    result = compare(refs["accum"], got)
    assert result.equal, (result.surfaces, result.first_mismatch)
    assert len(got.loss) == 2 * 2 * WORLD and got.ranks_equal


def test_sample_interleaving_breaks_parity(ddp: tuple[Path, dict[str, Surfaces]]) -> None:
    """Negative control: Lightning's DistributedSampler deals out samples, so the micro-batches differ."""
    out, refs = ddp
    got = _load(out / "interleaved.pt")
    result = compare(refs["plain"], got)
    assert len(got.loss) == len(refs["plain"].loss)
    assert not result.surfaces["loss"] and not result.surfaces["adapter"]
    assert got.ranks_equal  # the ranks still agree with each other


def test_one_shared_copy_of_the_base(ddp: tuple[Path, dict[str, Surfaces]]) -> None:
    ranks = json.loads((ddp[0] / "memory.json").read_text())
    store_kB = ranks[0]["store_bytes"] / 1024
    assert len(ranks) == WORLD and store_kB > 1000
    for rank in ranks:
        shm = rank["shared_base_kB"]
        assert shm["Rss"] >= store_kB  # every rank maps the whole base ...
        assert shm["Private"] == 0 and shm["Shared"] == shm["Rss"]  # ... and none holds a page of it alone
    total_pss = sum(rank["shared_base_kB"]["Pss"] for rank in ranks)
    assert store_kB <= total_pss <= store_kB + 4 * ranks[0]["blocks"]  # one copy, up to a 4 kB page per block


def test_checkpoint_written_by_rank_zero_only(ddp: tuple[Path, dict[str, Surfaces]]) -> None:
    markers = sorted(p.name for p in ddp[0].glob("last.ckpt.rank*"))
    assert markers == ["last.ckpt.rank0"]
    state = torch.load(ddp[0] / "last.ckpt", weights_only=False)["state_dict"]
    assert state and all("lora_" in k for k in state)


def test_micro_batch_sampler_deals_whole_micro_batches() -> None:
    data = list(range(10))
    for shuffle in (False, True):
        single = list(DataLoader(data, batch_size=2, sampler=MicroBatchSampler(data, 2, 1, 0, shuffle=shuffle)))
        ranks = [
            list(DataLoader(data, batch_size=2, sampler=MicroBatchSampler(data, 2, 2, r, shuffle))) for r in (0, 1)
        ]
        interleaved = [batch for pair in zip(*ranks, strict=True) for batch in pair]
        assert len(ranks[0]) == len(ranks[1]) == 3
        assert all(torch.equal(a, b) for a, b in zip(single, interleaved[:5], strict=False))
    assert [len(MicroBatchSampler(data, 2, 2, r, drop_last=True)) for r in (0, 1)] == [4, 4]


def test_dropout_is_refused_naming_the_fix() -> None:
    from poros_lightning.errors import PorosConfigError

    module = ParityModule(lambda: build_peft_model(tiny_config(num_hidden_layers=1), lora_dropout=0.1))
    with pytest.raises(PorosConfigError, match="lora_dropout=0") as err:
        PorosDDPStrategy()._check_exact(module)
    assert "accumulate_grad_batches" in str(err.value) and "HINT" in str(err.value)


def test_registered_name() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    PorosDDPStrategy.register_strategies(StrategyRegistry)
    assert isinstance(StrategyRegistry.get("poros_ddp"), PorosDDPStrategy)


# ----------------------------------------------------------------------------------------------------
# GPU gate: 2 ranks over NCCL vs one GPU accumulating 2


GPU_MODEL = os.environ.get("POROS_DDP_MODEL", "Qwen/Qwen2.5-7B")  # a name known to poros_lightning.arch.known
GPU_SEQ, GPU_STEPS = 512, int(os.environ.get("POROS_GPU_STEPS", "5"))


ONE_GPU = os.environ.get("POROS_DDP_ONE_GPU") == "1"  # the smoke layout: 2 "nodes" of 1 process on one GPU


def _gpu_fit(world: int, out: Path) -> None:
    from poros_lightning.arch.known import known_config
    from poros_lightning.tools.parity.build import build_peft_model as build_gpu

    torch.use_deterministic_algorithms(True)
    config = known_config(GPU_MODEL)
    device = "cuda:0" if ONE_GPU else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    L.seed_everything(0, verbose=False)
    module = ParityModule(lambda: build_gpu(config, device=device, lora_r=16, lora_dropout=0.0), lr=1e-3)
    L.seed_everything(0, verbose=False)
    rec = Surfaces()
    if world == 1:
        strategy, devices, nodes = PorosStrategy(), 1, 1
    elif ONE_GPU:
        strategy, devices, nodes = PorosDDPStrategy(process_group_backend="nccl", shared_base=False), 1, world
    else:
        strategy, devices, nodes = PorosDDPStrategy(), world, 1
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=devices,
        num_nodes=nodes,
        max_steps=GPU_STEPS,
        accumulate_grad_batches=1 if world > 1 else 2,
        callbacks=[rec],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    data = token_batches(config["vocab_size"], GPU_SEQ, 1, 2 * GPU_STEPS).dataset
    # 2 ranks: Lightning injects its shuffling sampler (seed 0) and the strategy deals it by micro-batch;
    # 1 GPU: the same order from a one-replica MicroBatchSampler
    sampler = MicroBatchSampler(data, 1, 1, 0, shuffle=True, seed=0) if world == 1 else None
    trainer.fit(module, DataLoader(data, batch_size=1, sampler=sampler))
    if trainer.is_global_zero:
        extra = {"seconds": time.perf_counter() - t0, "memory": getattr(rec, "memory", None)}
        if world > 1:
            import torch.distributed as dist

            extra["backend"] = dist.get_backend()
        torch.save({**rec.state(), **extra}, out / f"gpu_world{world}.pt")


def _write_gpu_gate(tmp_path: Path, suffix: str, got: SimpleNamespace, ref: SimpleNamespace, **facts: Any) -> Any:
    """Compare a 2-rank GPU run with its one-process reference; append the rows and a summary to the JSONL."""
    result = compare(ref, got)
    name = f"ddp_{GPU_MODEL.split('/')[-1].lower()}{suffix}.jsonl"
    artifacts = Path(os.environ.get("POROS_ARTIFACTS", tmp_path)) / "validation" / name
    artifacts.parent.mkdir(parents=True, exist_ok=True)
    model = f"{GPU_MODEL} (random init)"
    summary = {
        "summary": True,
        "model": model,
        "world_size": 2,
        **{k: facts[k] for k in ("topology", "reference") if k in facts},
        "steps": GPU_STEPS,
        "seq_len": GPU_SEQ,
        "micro_batch": 1,
        "lora_r": 16,
        "lora_dropout": 0.0,
        "backend": facts["backend"],
        "surfaces": result.surfaces,
        "equal": result.equal,
        "first_mismatch": result.first_mismatch,
        "seconds": {"ddp": got.seconds, "reference": ref.seconds},
        **({"host_memory": facts["host_memory"]} if "host_memory" in facts else {}),
        **versions(),
    }
    with artifacts.open("a") as f:
        for row in result.rows:
            f.write(json.dumps({"model": model, "world_size": 2, **row}) + "\n")
        f.write(json.dumps(summary) + "\n")
    return result


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_two_ranks_nccl_equal_one_gpu_accumulating(tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONPATH": root}
    for world in (2, 1):
        cmd = [sys.executable, str(Path(__file__).resolve()), f"gpu{world}", str(tmp_path)]
        proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=3000)
        assert proc.returncode == 0, proc.stderr[-6000:]
    got, ref = (_load(tmp_path / f"gpu_world{w}.pt") for w in (2, 1))
    result = _write_gpu_gate(
        tmp_path,
        "",
        got,
        ref,
        reference="1 GPU, accumulate_grad_batches=2",
        backend="nccl",
        host_memory=got.memory,
    )
    assert result.equal, result.first_mismatch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_nccl_smoke_two_processes_on_one_gpu(tmp_path: Path) -> None:
    """The NCCL path with the GPU one has: two rank processes on one device vs one process accumulating 2."""
    root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        "POROS_DDP_ONE_GPU": "1",
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "gpu2", str(tmp_path)]
    logs = [(tmp_path / f"node{r}.log").open("w") for r in range(2)]
    procs = [
        subprocess.Popen(
            cmd,
            env={**env, "NODE_RANK": str(r), "NCCL_HOSTID": f"poros-smoke-{r}"},
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for r, log in enumerate(logs)
    ]
    codes = [proc.wait(timeout=1500) for proc in procs]
    for log in logs:
        log.close()
    assert codes == [0, 0], "\n".join((tmp_path / f"node{r}.log").read_text()[-4000:] for r in range(2))
    single = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "gpu1", str(tmp_path)],
        env={k: v for k, v in env.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert single.returncode == 0, single.stderr[-6000:]
    got, ref = (_load(tmp_path / f"gpu_world{w}.pt") for w in (2, 1))
    result = _write_gpu_gate(
        tmp_path,
        "_one_gpu",
        got,
        ref,
        topology="2 processes on 1 GPU, each its own node (NCCL_HOSTID), NCCL socket transport on loopback",
        reference="1 process on the same GPU, accumulate_grad_batches=2",
        backend=got.backend,
    )
    assert got.backend == "nccl"
    assert result.equal, result.first_mismatch


if __name__ == "__main__":
    mode, target = sys.argv[1], Path(sys.argv[2])
    if mode == "cpu":
        _cpu_worker(target)
    else:
        _gpu_fit(int(mode.removeprefix("gpu")), target)
