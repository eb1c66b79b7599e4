#!/bin/bash
# For the next session with device time (written in session 11; one call, ~9 minutes).
# Issue 24: the root split on varying trees, the split and the tree mask in one call (session 11 lost the first `vary`
# process of calls 2 and 3 to its time limit: a fresh machine's first long_trees process pays cold compiles, so a
# warm-up process runs first).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 120 python3 bench/long_trees.py --sections vary --workloads long_prefix --configs auto-noroot \
    --repeats 0 --max-seconds 110 >/dev/null 2>&1  # warm-up: compile caches on this machine
for c in auto auto-noroot; do
  timeout -k 5 95 python3 bench/long_trees.py --sections vary --workloads long_prefix --configs $c \
    --repeats 6 --max-seconds 90 --out $OUT/long_trees_vary_$c.json 2>&1 | grep -v "$F" | grep "^vary.*median"
done
