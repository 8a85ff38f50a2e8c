"""The training kit: the LightningModule, data, model loading, tokenizers, adapter files, layer compilation.

Rule: what a fine-tune needs besides the streaming itself; it works under any Lightning strategy
(the parity reference runs it under ``SingleDeviceStrategy``). Imports: the engine's micro-batch
helpers, ``arch`` and ``quant``; never the Lightning seam (:mod:`poros_lightning.lightning`) or ``tools``.
"""
