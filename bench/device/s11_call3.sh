#!/bin/bash
# Session 11, call 3 (~7.5 minutes). (1) issue 25: the decode step's profile at 1,024 and 64 rows as bench_rollout
# runs them (every row at once, prefill pieces of 8,192 tokens; call 2's profile ran the engine's default budget),
# 512 new tokens, JSON after each case. (2) issue 24: the root split when the tree changes every step, the three
# grids in one call (each a fresh process: no earlier plans): the tree mask (auto-noroot), the grid of 128 (auto,
# the default), 16 points per octave (auto-b4); and auto-b4 on the fixed tree (its memory against the budget).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
echo "== profile"
timeout -k 5 170 python3 bench/profile_rollout.py --cases 0.6b:64x16,0.6b:8x8 --new-tokens 512 \
    --out $OUT/profile_rollout_s11.json 2>&1 | grep -v "$F" | tail -50
for c in auto auto-b4 auto-noroot; do
  echo "== vary long_prefix $c"
  timeout -k 5 85 python3 bench/long_trees.py --sections vary --workloads long_prefix --configs $c \
    --repeats 6 --max-seconds 80 --out $OUT/long_trees_vary3_$c.json 2>&1 | grep -v "$F" | grep "^vary.*median"
done
echo "== fixed long_prefix auto-b4"
timeout -k 5 50 python3 bench/long_trees.py --sections workloads --workloads long_prefix --configs auto-b4 \
    --repeats 1 --max-seconds 45 --out $OUT/long_trees_b4_fixed.json 2>&1 | grep -v "$F" | grep "^|" | tail -2
