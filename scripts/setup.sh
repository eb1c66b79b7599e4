#!/usr/bin/env bash
# Creates ./.venv with a CPU PyTorch and treerl (editable) unless it is already there.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# (Triton, for the CPU compile checks of the GPU kernels, comes with the dev extras on Linux x86-64 only)
imports="treerl, pytest, hypothesis, ray, scipy, fastapi, uvicorn, openai, prometheus_client, peft, agents"
[ "$(uname -sm)" = "Linux x86_64" ] && imports="$imports, triton"
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import $imports" 2>/dev/null; then
    python3 -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    # Pinned CPU torch first: an unpinned torch would pull several GB of CUDA packages.
    .venv/bin/pip install -q "torch==2.13.0"
    .venv/bin/pip install -q -e ".[dev]"
fi
