"""The streaming engine: torch only (no Lightning, bitsandbytes or transformers imports).

- :mod:`~poros_lightning.engine.store`: per-block host arenas (pinned).
- :mod:`~poros_lightning.engine.slots`: the device slot ring, copy stream, prefetch.
- :mod:`~poros_lightning.engine.block`: graph-preserving recompute of each streamed layer.
- :mod:`~poros_lightning.engine.engine`: :class:`StreamingEngine`, which ties them to a list of layers.
- :mod:`~poros_lightning.engine.microbatch`: block-major micro-batches (each block once for all of them).
- :mod:`~poros_lightning.engine.head`: the LM head's weight in host memory, on the device only while used.
- :mod:`~poros_lightning.engine.offload`: recomputed layers' saved inputs in host memory between forward and backward.
"""

from poros_lightning.engine.block import LayerStreamer
from poros_lightning.engine.engine import EngineOptions, StreamingEngine, move_resident
from poros_lightning.engine.slots import SlotRing
from poros_lightning.engine.store import HostStore

__all__ = ["EngineOptions", "HostStore", "LayerStreamer", "SlotRing", "StreamingEngine", "move_resident"]
