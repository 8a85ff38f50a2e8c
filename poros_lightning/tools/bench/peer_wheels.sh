#!/usr/bin/env bash
# Downloads, into .whl-peers/ (git-ignored), the wheels the peers of configs/bench/peers.yaml need on a GPU
# machine that has torch, transformers, peft, lightning, accelerate, safetensors, pyarrow, pandas, xxhash, fsspec,
# httpx, rich, typer and pyyaml but not these (bitsandbytes, which every peer needs, comes from .whl/ as for the
# rest of the bench). Python 3.12, manylinux x86_64. Run from the project root:
#   bash poros_lightning/tools/bench/peer_wheels.sh
# Two groups, which may be copied to the GPU machine separately (g1 first):
#   .whl-peers/g1  what both peers train through, and Soup (~6.7 MiB)
#   .whl-peers/g2  Unsloth (~30.1 MiB)
# There, with no network, each group is installed into one directory on PYTHONPATH (.whl/ with g1):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl .whl-peers/g1/*.whl
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl-peers/g2/*.whl
#   export PYTHONPATH=/tmp/site
# The versions are the newest both peers accept: trl <1.0 (soup-cli[train]) and <=1.15 (unsloth); datasets <5 and
# not 4.0.*, 4.1.0, 4.4.*, 4.5.0 (unsloth); pydantic 2.14 wants typing_extensions >= 4.16.
# Declared by the peers but not needed to import and train here, so not downloaded: xformers (optional in Unsloth,
# which falls back to torch's attention; its wheels are built for one torch release), torchao (Unsloth's fp8 and
# QAT paths), cut_cross_entropy (Unsloth turns it off from torch 2.8 on), msgspec (vLLM only), tyro, diffusers,
# hf_transfer, json5, nest-asyncio, structlog (Unsloth's CLI and studio, downloads), plotext (Soup's terminal plot).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
download() {  # download DIR PACKAGE==VERSION...
  local dir=$1
  shift
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "$@"
}
# g1: what both peers train through (trl, datasets and its dill/multiprocess), and Soup with its pydantic.
download .whl-peers/g1 \
  trl==0.29.1 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 \
  soup-cli==0.77.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
# g2: Unsloth.
download .whl-peers/g2 unsloth==2026.10.9 unsloth-zoo==2026.10.9
du -sh .whl-peers/g1 .whl-peers/g2
ls -la .whl-peers/g1 .whl-peers/g2
