#!/bin/bash
# Session 11, call 2 (~9.5 minutes). (1) issue 25: the decode step's profile at 1,024 and 64 rows with today's kernels
# (the last 1,024-row profile predates session 5's kernels). (2) issue 24: cuDNN's plans when the tree changes every
# step (call 1: the root split's gain, 0.23 s, went to 2 new plans a step): the coarse grid (BUCKET_BITS 3, default
# now) against the grid of 128 (auto-grid), 16 points per octave (auto-b4) and the tree mask (auto-noroot), each in a
# fresh process (no earlier plans), 8 steps after one; (3) fixed trees: the coarse grid costs the benchmarks' shapes
# nothing (auto against auto-grid).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
echo "== profile"
timeout -k 5 130 python3 bench/profile_rollout.py --cases 0.6b:64x16,0.6b:8x8 --new-tokens 256 \
    --out $OUT/profile_rollout_s11.json 2>&1 | grep -v "$F" | tail -30
for c in auto-grid auto auto-b4 auto-noroot; do
  echo "== vary long_prefix $c"
  timeout -k 5 70 python3 bench/long_trees.py --sections vary --workloads long_prefix --configs $c \
    --repeats 8 --max-seconds 60 --out $OUT/long_trees_vary_$c.json 2>&1 | grep -v "$F" | grep "^vary.*median"
done
echo "== fixed trees"
timeout -k 5 110 python3 bench/long_trees.py --sections workloads --workloads long_prefix,grpo,episodes --configs auto,auto-grid \
    --repeats 1 --max-seconds 100 --out $OUT/long_trees_grid_fixed.json 2>&1 | grep -v "$F" | grep "^|" | tail -7
