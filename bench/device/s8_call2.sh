#!/bin/bash
# Session 8, device call 2 (issue 24; carry [".v", ".dta"]): session 7's end (.v/base8 = git archive f8c8b18, its own
# src on PYTHONPATH) on episodes and long_prefix; then treerl (the one pass) against the DTA authors' engine on the
# same two shapes in one process; then the CUDA memory test (long trees within the default budget, whole device and a
# half-device limit, where the trees run as chains: the one pass).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
PYTHONPATH=.v/base8/src timeout -k 5 110 python3 .v/base8/bench/long_trees.py --sections workloads \
    --workloads episodes,long_prefix --configs auto --repeats 2 --max-seconds 95 --out $OUT/long_trees_s8_base.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s8_base.log | grep "^|" | tail -4
export PYTHONPATH=src
MAX_S=260 timeout -k 5 290 bash bench/device/dta_compare.sh --shapes long_prefix,episodes --engines auto,dta \
    --no-grad-check --repeats 2 2>&1 | tail -12
timeout -k 5 180 python3 -m pytest -v -s -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "long_trees" 2>&1 | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert\|budget" \
    | cut -c1-400 | tee $OUT/cuda_memory_s8.log | tail -8
