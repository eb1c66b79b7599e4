#!/bin/bash
# Device call (issue 24, chain attention after a prefix; <= 6 min): the CUDA tests, the kernel microbenchmark
# (bench/chain_attention.py), and long_prefix / episodes with the paths after a prefix on (auto, the default) and off (auto-off).
# Optional, a later call: CONFIGS=auto,auto-flash to time the chain path through flash's kernels only.
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout 90 python3 -m pytest -q -x -s -rs tests/cuda/test_chain_attention_cuda.py 2>&1 | grep -v "$F" | tail -25
timeout 100 python3 bench/chain_attention.py --out "$OUT/chain_attention_h100.json" 2>&1 | grep -v "$F" | tail -32
timeout 170 python3 bench/long_trees.py --sections workloads --configs "${CONFIGS:-auto,auto-off}" --max-seconds 130 \
    --out "$OUT/long_trees_chain_h100.json" 2>&1 | grep -v "$F" | tail -16
