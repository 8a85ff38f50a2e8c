"""The engine's options, defined once: their defaults, which ones a plan chooses, and how a choice is made.

``PorosStrategy``, ``PorosDDPStrategy``, :func:`poros_lightning.prepare`, the planner, the bench and the docs all
read this table (a test holds the strategies' signatures and the engine's ``EngineOptions`` to it). Torch-free,
so ``poros-lightning check`` can print plans without importing torch.

Note: [who decides]
    A strategy's engine options default to ``None``: "let the plan decide". With ``vram_budget="auto"`` (the
    default) or a size, the planner chooses every planned option; an option the user sets wins over the plan
    and the log names it. With ``vram_budget="off"`` there is no plan: unset options take the defaults below,
    the streaming engine's own (the smallest device footprint that needs no host-side option).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTO_MARGIN_BYTES", "AUTO_MARGIN_FRACTION", "OPTIONS", "Option", "auto_budget", "defaults", "resolve"]

AUTO_MARGIN_BYTES = 512 * 2**20
AUTO_MARGIN_FRACTION = 0.05
"""``vram_budget="auto"`` is the device's free memory at setup less ``max(512 MiB, 5%)`` of it (room for what the
estimate does not count: cuBLAS workspaces, the allocator's rounding, kernels' scratch memory, other processes),
or a per-process cap when one is set and smaller."""


@dataclass(frozen=True)
class Option:
    """One engine option: its name, the engine's default, whether a plan chooses it, and what it does."""

    name: str
    default: Any
    planned: bool
    doc: str


OPTIONS: tuple[Option, ...] = (
    Option("block_size", 1, True, "decoder layers per streamed block (the unit of copying)"),
    Option("prefetch", 1, True, "blocks copied ahead of the one computing"),
    Option("num_slots", None, False, "device slots in the ring (default prefetch + 1)"),
    Option("pin_memory", True, False, "page-lock the host copy of the base (CUDA only)"),
    Option("use_streams", True, False, "copy on a side CUDA stream (False: synchronous copies, for debugging)"),
    Option("resident_blocks", 0, True, "blocks kept on the device, spread over the model, copied once per run"),
    Option("keep_activations", 0, True, "last decoder layers that keep their activations (no recompute)"),
    Option("embeddings_on_host", False, True, "the input embedding table stays in host memory"),
    Option("head_on_host", False, True, "the LM head's weight stays in host memory, copied in for its uses"),
    Option("head_copies", 2, True, "head copies per step with head_on_host (1: the forward's copy serves both)"),
    Option("head_prefetch", True, True, "with head_on_host, its copy runs during the last layers' forwards"),
    Option("inputs_on_host", False, True, "recomputing layers' saved inputs wait in host memory"),
    Option("optimizer_on_host", False, True, "the optimizer's moments wait in host memory between steps"),
)
_BY_NAME = {o.name: o for o in OPTIONS}


def defaults() -> dict[str, Any]:
    """Every option's engine default (what ``vram_budget="off"`` uses for an unset option)."""
    return {o.name: o.default for o in OPTIONS}


def auto_budget(free_bytes: int, cap_bytes: int | None = None) -> int:
    """The ``"auto"`` budget: free device memory less the stated margin, within a per-process cap if one is set.

    A cap (``torch.cuda.set_per_process_memory_fraction``, a card emulated or shared on purpose) is the user's own
    statement of the budget, so it is taken as it is; the margin covers what free memory does not promise.
    """
    budget = int(free_bytes - max(AUTO_MARGIN_BYTES, AUTO_MARGIN_FRACTION * free_bytes))
    return max(min(budget, cap_bytes) if cap_bytes is not None else budget, 0)


def resolve(explicit: Mapping[str, Any], plan: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The options a run uses: the engine's defaults, then the plan's choices, then what the user set.

    Args:
        explicit: options the user set (``None`` values mean unset and are ignored).
        plan: the plan's choices, or ``None`` without a plan.

    Returns:
        The options, and one log line for each user setting that differs from the plan's choice.
    """
    chosen = defaults()
    chosen.update(plan or {})
    notes = []
    for name, value in explicit.items():
        if value is None or name not in _BY_NAME:
            continue
        if plan is not None and name in plan and plan[name] != value:
            notes.append(f"{name}={value!r} set explicitly (the plan chose {plan[name]!r})")
        chosen[name] = value
    return chosen, notes
