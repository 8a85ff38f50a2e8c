"""``poros-lightning export``'s command line: parses its arguments without importing torch, then calls
:func:`poros_lightning.tools.export.export` (so ``poros-lightning export --help`` answers at once)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from poros_lightning.tools.export_spec import MERGE_INTO

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``poros-lightning export``."""
    parser = argparse.ArgumentParser(
        prog="poros-lightning export",
        description="Merge a LoRA adapter into its base and write a sharded safetensors Hugging Face checkpoint.",
    )
    parser.add_argument("adapter_dir", help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    parser.add_argument("--base", required=True, help="base model: local directory or hub id in the local cache")
    parser.add_argument("-o", "--output", required=True, help="output directory")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="output dtype")
    parser.add_argument(
        "--merge-into",
        default="nf4",
        choices=MERGE_INTO,
        help="nf4: the dequantized quantized base the adapter was trained against (default); original: the "
        "base checkpoint's own weights",
    )
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    parser.add_argument(
        "--device",
        default=None,
        help="device for the nf4 quantize/dequantize (default: where training quantized, else cpu)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty output directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line instead")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``poros-lightning export ADAPTER_DIR --base MODEL -o OUT_DIR [options]``; returns the exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from poros_lightning.tools.export import export, format_result

    result = export(
        args.adapter_dir,
        args.base,
        args.output,
        dtype=args.dtype,
        merge_into=args.merge_into,
        max_shard_size=args.max_shard_size,
        progress=not args.no_progress,
        force=args.force,
        device=args.device,
    )
    print(json.dumps(result.to_dict()) if args.json else format_result(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
