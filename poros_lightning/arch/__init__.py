"""Architecture registry keyed by HF ``model_type``: where the blocks, embeddings, final norm and head live.

Importing this package imports neither torch nor transformers (``poros-lightning check`` relies on it).
See ``docs/architecture-support.md`` for the supported families and how to add one.
"""

from __future__ import annotations

from poros_lightning.arch.known import known_config, known_ids
from poros_lightning.arch.registry import (
    DOC_LINK,
    MOE_MODEL_TYPES,
    STANDARD_TARGETS,
    ArchSpec,
    Status,
    UnlistedArchitectureWarning,
    arch_for_config,
    arch_for_model,
    get_arch,
    guarantee,
    registered,
    resolve,
    transformers_knows,
)
from poros_lightning.arch.shapes import LayerShape, Linear, ModelShapes, model_shapes
from poros_lightning.arch.status import Gate

__all__ = [
    "DOC_LINK",
    "MOE_MODEL_TYPES",
    "STANDARD_TARGETS",
    "ArchSpec",
    "Gate",
    "LayerShape",
    "Linear",
    "ModelShapes",
    "Status",
    "UnlistedArchitectureWarning",
    "arch_for_config",
    "arch_for_model",
    "get_arch",
    "guarantee",
    "known_config",
    "known_ids",
    "model_shapes",
    "registered",
    "resolve",
    "transformers_knows",
]
