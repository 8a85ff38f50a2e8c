"""The memory model: what a plan costs on the device, without importing torch.

Rule: pure arithmetic over a model's config (``arch.shapes``) and the engine's options, shared by
``poros-lightning check`` (which never imports torch) and the strategies' planner. Imports: ``arch``
and ``errors`` only.
"""
