"""The planner's kept-activation estimate against what a decoder layer really saves, for every registered family.

Each family's decoder layer runs forward under PEFT LoRA (all default targets, dropout 0) over a frozen bf16 base on
the CPU, at the family's proportions and small widths (:mod:`poros_lightning.tools.activation_probe`); every tensor
its autograd graph saves is counted once by storage. The estimate (``activation_layer_bytes``, the largest layer,
with :data:`~poros_lightning.memory.estimate.LAYER_SAVES_FACTOR`) must cover the largest layer's measurement and stay
within 1.25 times it: a plan sized on a low estimate runs out of memory (docs/benchmarks/families.jsonl), one sized on
a high one wastes the budget.
"""

from __future__ import annotations

import pytest

from poros_lightning.arch import transformers_knows
from poros_lightning.tools.activation_probe import CONFIGS, measure


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_estimate_covers_what_a_layer_saves(model_type: str) -> None:
    if transformers_knows(model_type) is False:
        pytest.skip(f"the installed transformers does not define {model_type}")
    row = measure(dict(CONFIGS[model_type], vocab_size=512), 256, model_type)
    assert row["measured_max_bytes"] <= row["estimate_bytes"] <= 1.25 * row["measured_max_bytes"], row
