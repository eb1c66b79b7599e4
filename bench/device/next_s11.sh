#!/bin/bash
# For the next session with device time (written in session 10). One call (~9 minutes), issue 24:
# (1) cuDNN's plan per shape in a run whose tree changes every step (bench/RESULTS.md, session 10, "Open"): long_prefix
#     with a new tree each step (prompt 30,000-34,000 tokens), the root split off then on (a fresh process: no
#     earlier plans), 6 steps after one; and episodes likewise (its chain pieces and groups through cuDNN). If the
#     split's steps with new shapes lose more than they gain, bound cuDNN to shapes that recur or bucket the
#     split's lengths coarser.
# (2) the root split for calls of several trees (built in session 10 on the CPU, ROOT_SPLIT_MAX_TREES, default 1):
#     its bf16 CUDA tests, then the workload long (two trees of a 12k prompt in one call: the tree mask today,
#     1.31 s, 51% of peak) against auto-roots. Predicted: attention ~0.45 -> ~0.3 s of the step, fewer kept layers
#     (~0.05-0.1 s back): 1.2-1.25 s (53-56%). If it wins: ROOT_SPLIT_MAX_TREES = 8 by default, memory test again.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 170 python3 bench/long_trees.py --sections vary --workloads long_prefix --configs auto-noroot,auto \
    --repeats 6 --max-seconds 150 --out $OUT/long_trees_vary_long_prefix.json 2>&1 | grep -v "$F" | grep "^vary" | tail -16
timeout -k 5 90 python3 -m pytest -q -m cuda tests/cuda/test_chain_attention_cuda.py -p no:cacheprovider -rfE \
    --tb=short -k "root_split" 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|Error\|assert" | cut -c1-300 | tail -5
timeout -k 5 150 python3 bench/long_trees.py --sections workloads --workloads long,grpo --configs auto,auto-roots \
    --repeats 2 --max-seconds 140 --out $OUT/long_trees_roots.json 2>&1 | grep -v "$F" | grep "^|" | tail -5
timeout -k 5 150 python3 bench/long_trees.py --sections vary --workloads episodes --configs auto \
    --repeats 4 --max-seconds 130 --out $OUT/long_trees_vary_episodes.json 2>&1 | grep -v "$F" | grep "^vary" | tail -8
