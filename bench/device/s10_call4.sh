#!/bin/bash
# Session 10, call 4 (issue 24 item 2): one layer's attention, forward+backward, in one run: the tree attention
# on long_prefix's tree (the tree mask through flex, and the engine's route: the root split, on by default) beside
# SDPA's cuDNN and flash causal kernels on one sequence of the same length (bench/long_trees.py's attention
# section, now with that shape); the fused-kernel CUDA tests at the new default.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 200 python3 bench/long_trees.py --sections attention --max-seconds 180 \
    --out $OUT/long_trees_s10_attention.json 2>&1 | grep -v "$F" | tee $OUT/long_trees_s10_attention.log \
    | grep "^|\|route" | tail -16
timeout -k 5 150 python3 -m pytest -q -m cuda tests/cuda/test_chain_attention_cuda.py -p no:cacheprovider -rfE \
    --tb=short 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|Error\|assert" | cut -c1-300 \
    | tee $OUT/cuda_chain_s10.log | tail -5
