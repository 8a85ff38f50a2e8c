"""``compile_layers(model)``: ``torch.compile`` each decoder layer, the unit that stays exact when streamed.

Note: [compile mode]
    Compile the same regions in a resident and a streamed run: each decoder layer's own forward.
    Compiling the whole model lets inductor fuse across layer boundaries (a residual add with the next
    layer's norm, fp32 intermediates left unrounded); a model whose layers run one at a time (streamed,
    or checkpointed) cannot reproduce those kernels, so whole-model compile changes the bytes. Compiled
    per layer, the engine wraps the compiled forward like any other and the recompute calls it again:
    the parity gates (``mode: compile``) find all four surfaces equal. This module uses the architecture
    registry only, no engine code, so a resident reference can use it too.
"""

from __future__ import annotations

import types

import torch
from torch import nn

__all__ = ["compile_layers"]

_FLAG = "_poros_compiled"


def compile_layers(model: nn.Module, **compile_kwargs: object) -> int:
    """Replace each decoder layer's ``forward`` by ``torch.compile(forward)``, in place; returns how many.

    Idempotent: a layer compiled before is left as it is. ``model`` is a (PEFT-wrapped) causal LM of a
    registered architecture; call it before ``prepare`` or ``fit``. ``compile_kwargs`` go to
    ``torch.compile`` (e.g. ``mode="max-autotune-no-cudagraphs"``; CUDA graphs cannot capture the
    streamed copies).
    """
    from poros_lightning.arch import arch_for_model, resolve

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    count = 0
    for layer in resolve(base, arch_for_model(base, allow_unlisted=True).layers):
        if not getattr(layer, _FLAG, False):
            # Bound to the layer (not a closure over it): a deep copy of the model rebinds to the copy.
            layer.forward = types.MethodType(torch.compile(type(layer).forward, **compile_kwargs), layer)
            setattr(layer, _FLAG, True)
            count += 1
    return count
