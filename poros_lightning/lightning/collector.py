"""Python's garbage collector during a fit: what setup built is left out of every collection (Note: [frozen setup]).

Note: [frozen setup]
A full collection scans every container object the collector tracks. After setup most of those are the
model's: its modules, parameters, quantization states and the engine's records, which never become garbage.
A streamed step creates many short-lived container objects (a checkpoint record per layer and micro-batch,
autograd's Python-side objects), and those allocations trigger collections; every full one rescans the whole
model from the host thread, while the device waits whenever the step is bound by the host. ``gc.freeze()`` at
the start of training moves every object that exists then to a permanent generation that collections skip.
Nothing a step computes changes: the collector only frees reference cycles, and freezing postpones freeing
cycles that existed at the start of training until ``gc.unfreeze()`` when training ends. Objects created
during training are collected as before. A process that arrives already frozen (the user's or another
library's ``gc.freeze()``, common before forking workers) is left as it is: freezing again and thawing at the
end would undo that freeze.
"""

from __future__ import annotations

import gc

__all__ = ["FrozenSetup"]


class FrozenSetup:
    """Freeze the collector's view of what exists at the start of training; thaw it when training ends."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = bool(enabled)
        self.frozen = False

    def freeze(self) -> None:
        if self.enabled and not self.frozen and gc.get_freeze_count() == 0:
            gc.collect()  # setup's garbage goes first: frozen, it would stay until the thaw
            gc.freeze()
            self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
