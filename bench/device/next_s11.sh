#!/bin/bash
# For the next session with device time (written in session 10). One call (~6 minutes), issue 24:
# (1) cuDNN's plan per shape in a run whose tree changes every step (bench/RESULTS.md, session 10, "Open"): long_prefix
#     with a new tree each step (prompt 30,000-34,000 tokens), the root split off then on (a fresh process: no
#     earlier plans), 6 steps after one; and episodes likewise (its chain pieces and groups through cuDNN). If the
#     split's steps with new shapes lose more than they gain, bound cuDNN to shapes that recur or bucket the
#     split's lengths coarser.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 200 python3 bench/long_trees.py --sections vary --workloads long_prefix --configs auto-noroot,auto \
    --repeats 6 --max-seconds 180 --out $OUT/long_trees_vary_long_prefix.json 2>&1 | grep -v "$F" | grep "^vary" | tail -16
timeout -k 5 200 python3 bench/long_trees.py --sections vary --workloads episodes --configs auto \
    --repeats 4 --max-seconds 180 --out $OUT/long_trees_vary_episodes.json 2>&1 | grep -v "$F" | grep "^vary" | tail -8
