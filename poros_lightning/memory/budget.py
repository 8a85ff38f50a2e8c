"""The smallest VRAM budget the planner accepts: every host-side option on, found with the planner itself.

Invariant: ``plan_engine(cfg, minimum_budget(cfg, ...), ...)`` returns a plan and one byte less raises
``PorosOOMError``; the answer is searched over :func:`~poros_lightning.memory.planner.plan_engine`, so it stays
what the planner does however its estimates change. Torch-free, like the planner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from poros_lightning.errors import PorosOOMError
from poros_lightning.memory.planner import plan_engine

__all__ = ["minimum_budget"]


def minimum_budget(
    cfg: Mapping[str, Any],
    *,
    seq_len: int = 512,
    batch_size: int = 1,
    lora_r: int = 16,
    quantization: str = "nf4-dq",
    lora_targets: Sequence[str] | None = None,
    head_frozen: bool = True,
    loss_chunk_tokens: int | None = None,
    micro_batches: int = 1,
    workspace_bytes: int | None = None,
) -> int:
    """The smallest VRAM budget (bytes) :func:`plan_engine` accepts with these arguments.

    That is the need of its smallest plan, every host-side option on that the model allows (input embeddings,
    optimizer moments, LM head, layer inputs in host memory): the figure its ``PorosOOMError`` names. Not
    ``MemoryPlan.streamed_vram_min``, which keeps all of them on the device. Where turning an option on costs
    more than it saves (a long adapter beside short activations), a budget between the needs of two steps of
    the plan fits as well: the answer is the smallest budget that fits, found by bisection over
    :func:`plan_engine` itself, so it stays what the planner does.

    Raises:
        PorosConfigError: an argument is out of range.
        PorosOOMError: no budget up to 1 PB fits (a config that is not a model's).
    """

    # What spare memory buys does not change what fits: keep_activations=False skips choosing it.
    args = dict(seq_len=seq_len, batch_size=batch_size, lora_r=lora_r, quantization=quantization)
    args.update(lora_targets=lora_targets, head_frozen=head_frozen, keep_activations=False)
    args.update(loss_chunk_tokens=loss_chunk_tokens, micro_batches=micro_batches, workspace_bytes=workspace_bytes)

    def fits(budget: int) -> bool:
        try:
            plan_engine(cfg, budget, **args)
        except PorosOOMError:
            return False
        return True

    try:
        plan_engine(cfg, 1, **args)
    except PorosOOMError as err:
        high = err.needed_bytes
    else:
        return 1  # nothing to plan for (an empty model)
    if high is None or not fits(high):  # a refusal that names no figure: search upward from 1 GB
        high = 10**9
        while not fits(high):
            if high > 10**15:
                raise PorosOOMError(
                    "No VRAM budget up to 1 PB fits this model's smallest plan.",
                    "Check the model config (vocab_size, hidden_size, num_hidden_layers) and seq_len.",
                )
            high *= 2
    low = 1  # refused
    while high - low > 1:  # fitting is monotone in the budget: a larger budget turns fewer options on
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return high
