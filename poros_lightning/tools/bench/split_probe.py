"""Does splitting the LM head's GEMMs change their bytes? The evidence behind the resident head.

A streamed, vocabulary-chunked LM head would compute the logits and their input gradient in pieces.
That is exact only if cuBLAS returns the same bytes for a piece as for the same rows or columns of
the whole product. This probe checks it on the shapes of the Qwen2.5 heads (vocabulary 152064,
hidden 3584 / 5120 / 8192, 128-512 tokens) under deterministic settings::

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m poros_lightning.tools.bench.split_probe --out docs/validation/gemm_split_probe.jsonl

Measured on an H200 (``docs/validation/gemm_split_probe.jsonl``): the forward product is unchanged by
splitting the vocabulary or the tokens (except one 32-way split), but the backward product
``grad_logits @ W`` (a reduction over the 152064-long vocabulary) differs at every shape, under most
splits by tokens or by hidden columns: cuBLAS picks its reduction per shape, so which split happens to
be exact depends on the shape and the library, and none is exact for all. A streamed head is therefore
not bit-exact, and poros-lightning keeps the head resident (see docs/limitations.md).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["probe"]

VOCAB = 152064


def probe(hidden: int, tokens: int, device: str = "cuda") -> dict[str, Any]:
    """torch.equal of whole vs split head GEMMs (forward and input gradient) for one shape."""
    import torch
    import torch.nn.functional as F

    weight = torch.randn(VOCAB, hidden, device=device, dtype=torch.bfloat16) * 0.02
    h = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    full = F.linear(h, weight)
    res: dict[str, Any] = {"K": hidden, "M": tokens}
    for n in (8, 16, 32):
        res[f"fwd_vocab_split{n}"] = torch.equal(full, torch.cat([F.linear(h, w) for w in weight.chunk(n, 0)], 1))
    for m in (2, 4, 8):
        res[f"fwd_token_split{m}"] = torch.equal(full, torch.cat([F.linear(x, weight) for x in h.chunk(m, 0)], 0))
    g = torch.randn(tokens, VOCAB, device=device, dtype=torch.bfloat16) * 1e-3
    gfull = g.matmul(weight)
    for n in (2, 4, 8):
        parts = [g.matmul(w.contiguous()) for w in weight.chunk(n, 1)]
        res[f"bwd_hidden_split{n}"] = torch.equal(gfull, torch.cat(parts, 1))
    for m in (2, 4, 8):
        res[f"bwd_token_split{m}"] = torch.equal(gfull, torch.cat([x.matmul(weight) for x in g.chunk(m, 0)], 0))
    logits = full.float()
    whole = torch.log_softmax(logits, -1)
    res["logsoftmax_token_split4"] = torch.equal(
        whole, torch.cat([torch.log_softmax(x, -1) for x in logits.chunk(4, 0)], 0)
    )
    return res


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(
        prog="python -m poros_lightning.tools.bench.split_probe", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("The split probe measures cuBLAS: it needs a CUDA GPU.")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for hidden in (3584, 5120, 8192):
            for tokens in (512, 256, 128):
                row = {**probe(hidden, tokens), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
                print(json.dumps(row), flush=True)
                f.write(json.dumps(row) + "\n")
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
