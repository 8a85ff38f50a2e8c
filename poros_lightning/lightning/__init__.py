"""The Lightning seam: strategies, the precision plugin, checkpoints and callbacks.

Rule: thin adapters over :mod:`poros_lightning.api` and the engine. Lightning's hooks decide *when*
(setup, teardown, checkpoint, each batch); the engine decides *how*. Nothing here streams a byte itself.
Imports: the engine, ``arch``, ``quant``, ``memory``, ``api`` and the training kit; never ``tools``.
"""
