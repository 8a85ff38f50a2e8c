"""The LM head and the next-token cross-entropy in chunks of tokens: the full fp32 logits never exist.

Invariant: each chunk's logits come from the head module itself (so its hooks fire: a head kept in host
memory, block-major micro-batches), soft-capped in their own dtype and upcast to fp32 as the model's forward
and :func:`poros_lightning.training.module.causal_lm_loss` do; the loss is the chunks' cross-entropy sums added in
chunk order, over the labelled-token count. The forward keeps only the hidden states; the backward recomputes
each chunk's logits (same kernels, same bytes, same RNG draws, same autocast state) and writes that chunk's
rows of the hidden-state gradient. Nothing depends on where the base's bytes live: a resident and a streamed
run compute the same bytes.

Note: [chunked vs unchunked]
    Per element, the chunked logits, their soft cap, the upcast and the cross-entropy gradient are the
    operations of the unchunked loss. Two things differ: the order of the loss's sum (within each chunk,
    then chunk by chunk), and the head matmul's row count (a GEMM may block its rows differently). So the
    loss and the gradients differ from the unchunked ones in the last bits; ``docs/parity.md`` gives the
    measured differences and the test that regenerates them.

Note: [memory and time]
    The forward holds one chunk's logits at a time (bf16, their fp32 upcast, the log-softmax), the
    backward one chunk's logits with their gradients: about ``10 x chunk x vocabulary`` bytes instead of
    ``10 x tokens x vocabulary``. The price is one more head forward per step (the recompute), and
    positions without a label still get logits (the chunks are fixed by the shape, never by the data, so
    nothing waits on the device to learn how many there are).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from poros_lightning.errors import PorosConfigError

if TYPE_CHECKING:
    from poros_lightning.arch import ArchSpec
    from poros_lightning.engine.head import HostHead

__all__ = [
    "check_chunk_tokens",
    "chunked_causal_lm_eval",
    "chunked_causal_lm_loss",
    "final_logit_softcap",
    "peft_chunked_loss",
]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_chunk_tokens(value: Any) -> int | None:
    """Return ``value`` if it is ``None`` or a positive integer, else raise :class:`PorosConfigError`."""
    if value is None or _positive_int(value):
        return value
    raise PorosConfigError(
        f"loss_chunk_tokens must be a positive integer (tokens per chunk of the LM head and loss) or None, got "
        f"{value!r}.",
        "Set model.loss_chunk_tokens to a number of tokens such as 1024 (or --model.loss_chunk_tokens on the "
        "command line), or leave it unset (None) for the unchunked loss.",
    )


def final_logit_softcap(config: Any, spec: ArchSpec) -> float | None:
    """The soft cap the model's own forward applies to the head's output (``None``: none).

    Raises:
        PorosConfigError: the layout is guessed (an unlisted model type) and the config sets
            ``final_logit_softcapping``: whether that model's forward applies it is unknown.
    """
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    cap = getattr(text, "final_logit_softcapping", None)
    if spec.logit_softcap:
        return float(cap) if cap is not None else None
    if spec.guessed and cap is not None:
        raise PorosConfigError(
            f"loss_chunk_tokens applies the LM head itself, but this unlisted {spec.model_type} model sets "
            f"final_logit_softcapping={cap} and the registry cannot tell whether its forward applies it.",
            "Leave loss_chunk_tokens unset for this model (the model's own forward computes the logits), or "
            "register the family with logit_softcap (docs/architecture-support.md).",
        )
    return None


@dataclass(frozen=True)
class _Head:
    """What the chunked loss needs to call the head, shared by its forward and backward."""

    module: nn.Module
    chunk: int
    softcap: float | None
    ignore_index: int
    host: HostHead | None
    context: Callable[[], contextlib.AbstractContextManager[Any]]
    draws: bool  # the head draws random numbers (dropout): the backward replays the forward's draws

    def hold(self, group: Any = None) -> contextlib.AbstractContextManager[Any]:
        return self.host.hold(group) if self.host is not None else contextlib.nullcontext()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """One chunk's logits, through the head module, soft-capped as the model's forward does."""
        logits = self.module(hidden)
        if self.softcap is not None:  # as the model's forward: in the logits' dtype, before the upcast
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        return logits

    def chunk_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The cross-entropy sum of one chunk, in fp32 (Note: [chunked vs unchunked])."""
        return F.cross_entropy(self.logits(hidden).float(), targets, ignore_index=self.ignore_index, reduction="sum")

    def spans(self, n: int) -> Iterator[slice]:
        return (slice(s, min(s + self.chunk, n)) for s in range(0, n, self.chunk))


def _draws_random(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in module.modules())


def _autocast_state(device: torch.device) -> list[tuple[str, bool, torch.dtype]]:
    kinds = dict.fromkeys([device.type, "cpu"])
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in kinds]


class _ChunkedLoss(torch.autograd.Function):
    """Sum of the chunks' cross-entropy sums; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, head: _Head, *params: torch.Tensor
    ) -> torch.Tensor:
        device = hidden.device
        ctx.head, ctx.device, ctx.autocast = head, device, _autocast_state(device)
        ctx.rng = None
        if head.draws:
            cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
            ctx.rng = (torch.get_rng_state(), cuda)
        total = None
        with head.hold() as group:
            for span in head.spans(hidden.shape[0]):
                part = head.chunk_sum(hidden[span], targets[span])
                total = part if total is None else total + part
            # One copy of a host head's weight serves every chunk's backward (Note: [held weight] in engine.head).
            ctx.group = head.host.reserve(group) if head.host is not None and any(ctx.needs_input_grad) else None
        ctx.save_for_backward(hidden, targets, *params)
        assert total is not None  # a batch has at least one token
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, *params = ctx.saved_tensors
        head: _Head = ctx.head
        device: torch.device = ctx.device
        needs_hidden = ctx.needs_input_grad[0]
        wanted = [i for i, needed in enumerate(ctx.needs_input_grad[3:]) if needed]
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grads: list[torch.Tensor | None] = [None] * len(params)
        with contextlib.ExitStack() as stack:
            # Replay the forward's random draws, then leave the generators as the forward left them.
            devices = [device] if device.type == "cuda" else []
            stack.enter_context(
                torch.random.fork_rng(devices=devices, enabled=ctx.rng is not None, device_type=device.type)
            )
            if ctx.rng is not None:
                torch.set_rng_state(ctx.rng[0])
                if ctx.rng[1] is not None:
                    torch.cuda.set_rng_state(ctx.rng[1], device)
            for kind, enabled, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            stack.enter_context(head.context())
            stack.enter_context(head.hold(ctx.group))
            for span in head.spans(hidden.shape[0]):  # forward order: the draws come in the forward's order
                with torch.enable_grad():
                    h = hidden[span].detach().requires_grad_(needs_hidden)
                    loss = head.chunk_sum(h, targets[span])
                    inputs = ([h] if needs_hidden else []) + [params[i] for i in wanted]
                    got = list(torch.autograd.grad(loss, inputs, grad_total, allow_unused=True))
                if grad_hidden is not None:
                    grad_hidden[span] = got.pop(0)
                for i, g in zip(wanted, got, strict=True):
                    if g is not None:
                        grads[i] = g if grads[i] is None else grads[i] + g  # chunk order
        return (grad_hidden, None, None, *grads)


def _shifted_targets(labels: torch.Tensor, device: torch.device, ignore_index: int) -> torch.Tensor:
    """``[B * T]`` targets: position ``t`` of row ``b`` predicts ``labels[b, t + 1]``; a row's last predicts nothing."""
    last = labels.new_full((labels.shape[0], 1), ignore_index)
    return torch.cat([labels[:, 1:], last], 1).reshape(-1).to(device)


def _spec(
    head: nn.Module,
    chunk_tokens: int,
    softcap: float | None,
    host_head: HostHead | None,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    ignore_index: int,
) -> _Head:
    if not _positive_int(chunk_tokens):
        raise PorosConfigError(
            f"chunk_tokens must be a positive integer, got {chunk_tokens!r}.", "Pass chunk_tokens >= 1."
        )
    return _Head(
        head, chunk_tokens, softcap, ignore_index, host_head, context or contextlib.nullcontext, _draws_random(head)
    )


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Module,
    chunk_tokens: int,
    *,
    softcap: float | None = None,
    host_head: HostHead | None = None,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``head(hidden)``, computed ``chunk_tokens`` positions at a time.

    The loss :func:`poros_lightning.training.module.causal_lm_loss` computes from the model's logits, without the
    ``[B, T, V]`` logits: the ``B x T`` positions are taken row after row in chunks of ``chunk_tokens``; each
    chunk's logits exist only while that chunk computes, in the forward and again in the backward, which
    recomputes them (Note: [chunked vs unchunked] says how the result differs from the unchunked loss).

    Args:
        hidden: ``[B, T, H]`` final hidden states (the decoder's output, after its final norm).
        labels: ``[B, T]`` token ids aligned with the inputs, ``ignore_index`` where no loss is taken.
        head: the LM head module; it is called on ``[n, H]`` chunks.
        chunk_tokens: positions per chunk.
        softcap: the model's final logit soft cap (``cap * tanh(logits / cap)``), or ``None``.
        host_head: the engine's :class:`~poros_lightning.engine.head.HostHead` for ``head``, when its weight
            waits in host memory: one copy serves all chunks (Note: [held weight] in engine.head).
        context: entered around the backward's recompute (e.g.
            :func:`~poros_lightning.engine.microbatch.whole_batches`).
        ignore_index: the label value that carries no loss.
    """
    spec = _spec(head, chunk_tokens, softcap, host_head, context, ignore_index)
    b, t, width = hidden.shape
    targets = _shifted_targets(labels, hidden.device, ignore_index)
    params = [p for p in head.parameters() if p.requires_grad]
    total = _ChunkedLoss.apply(hidden.reshape(b * t, width), targets, spec, *params)
    count = (targets != ignore_index).sum()
    return total / count.clamp_min(1)


def peft_chunked_loss(
    model: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Module,
    chunk_tokens: int,
    *,
    softcap: float | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """:func:`chunked_causal_lm_loss` of the PEFT ``model``'s final hidden states, as a training step takes it.

    The engine's host-memory head, when it keeps ``head``, serves every chunk with one copy (Note: [held weight] in
    engine.head); with block-major micro-batches installed, one loss per micro-batch, averaged as accumulation does,
    and the backward calls the head per chunk of one micro-batch.
    """
    import functools

    from poros_lightning.api import engine_of
    from poros_lightning.engine.microbatch import micro_batch_mean, micro_batch_sizes, micro_batches_of, whole_batches

    host = getattr(engine_of(model), "host_head", None)
    host = host if host is not None and host.module is head else None
    loss_fn = functools.partial(
        chunked_causal_lm_loss,
        head=head,
        chunk_tokens=chunk_tokens,
        softcap=softcap,
        host_head=host,
        context=functools.partial(whole_batches, model),
        ignore_index=ignore_index,
    )
    k = micro_batches_of(model)
    with host.hold() if host is not None else contextlib.nullcontext():
        if k > 1:
            return micro_batch_mean(loss_fn, k, hidden, labels, sizes=micro_batch_sizes(model, labels.shape[0]))[0]
        return loss_fn(hidden, labels)


@torch.no_grad()
def chunked_causal_lm_eval(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Module,
    chunk_tokens: int,
    *,
    softcap: float | None = None,
    host_head: HostHead | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss of :func:`chunked_causal_lm_loss` without gradients, and each position's predicted token.

    Returns:
        The mean loss, the ``[B * T]`` argmax predictions of the (soft-capped) logits, and the ``[B * T]``
        targets they predict (``ignore_index`` at each row's last position and wherever ``labels`` has it).
    """
    spec = _spec(head, chunk_tokens, softcap, host_head, None, ignore_index)
    b, t, width = hidden.shape
    flat = hidden.reshape(b * t, width)
    targets = _shifted_targets(labels, hidden.device, ignore_index)
    total, predictions = None, []
    with spec.hold():
        for span in spec.spans(b * t):
            logits = spec.logits(flat[span])
            predictions.append(logits.argmax(-1))
            part = F.cross_entropy(logits.float(), targets[span], ignore_index=ignore_index, reduction="sum")
            total = part if total is None else total + part
    assert total is not None
    count = (targets != ignore_index).sum()
    return total / count.clamp_min(1), torch.cat(predictions), targets
