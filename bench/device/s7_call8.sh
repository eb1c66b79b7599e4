#!/bin/bash
# Session 7, device call 8 (issue 24): long_prefix and episodes at memory budgets 20% (then the default), 30%, 45%.
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout -k 5 520 python3 bench/long_trees.py --sections workloads --workloads long_prefix,episodes \
    --configs auto,auto-b0.3,auto-b0.45 --repeats 1 --max-seconds 480 --out $OUT/long_trees_s7_budget.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s7_budget.log | tail -25
