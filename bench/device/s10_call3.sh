#!/bin/bash
# Session 10, call 3 (issue 24): the root split on by default (ROOT_SPLIT = "cuda") with the lone call's margin cut
# to BACKWARD_MARGIN's surplus (call 2: the second block's activations are held; the split's kept attentions took
# them and peaked 2.7 GiB over the budget). (1) long_prefix and long at the new defaults beside auto-noroot (the
# tree mask), episodes; (2) the CUDA memory test (long trees within the default budget, both limits), now with the
# split; (3) long_prefix against the DTA authors' engine in the same process at the new defaults.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 200 python3 bench/long_trees.py --sections workloads --workloads long_prefix,long,episodes \
    --configs auto,auto-noroot --repeats 2 --max-seconds 180 --out $OUT/long_trees_s10_default.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s10_default.log | grep "^|" | tail -7
timeout -k 5 140 python3 -m pytest -v -s -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "long_trees" 2>&1 | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert\|budget" \
    | cut -c1-600 | tee $OUT/cuda_memory_s10.log | tail -8
MAX_S=120 timeout -k 5 150 bash bench/device/dta_compare.sh --shapes long_prefix --engines auto,dta \
    --no-grad-check --repeats 2 2>&1 | tail -4
