#!/bin/bash
# Session 7, device call 9 (issue 24): with the default budget at 25%: the six shapes for auto (25%), auto-b0.2 and
# dfs, then the CUDA memory test (4k-64k trees, whole device and a half-device limit).
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
grep -n "^DEFAULT_BUDGET_FRACTION" src/treerl/engine/memory.py
timeout -k 5 330 python3 bench/long_trees.py --sections workloads --workloads long_prefix,episodes,grpo,agentic,long,tree \
    --configs auto,auto-b0.2,dfs --repeats 1 --max-seconds 300 --out $OUT/long_trees_s7_b025.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s7_b025.log | grep "^|" | tail -22
timeout -k 5 230 python3 -m pytest -v -s -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "long_trees" 2>&1 | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert\|budget" \
    | cut -c1-400 | tee $OUT/cuda_memory_s7.log | tail -8
