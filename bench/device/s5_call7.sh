#!/bin/bash
# Device call 7 (session 5, issue 24): with the paths after a prefix on by default on CUDA, the engine's CUDA tests
# that run bf16 trees with prefixes at defaults: memory within the budget on 4k-64k trees (whole device and a
# half-device limit), no host sync per segment, then the chain/group engine tests.
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout -k 5 330 python3 -m pytest -v -s -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "long_trees or no_host_sync" 2>&1 | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert\|budget" \
    | cut -c1-400 | tee $OUT/cuda_s5_call7.log | tail -12
timeout -k 5 200 python3 -m pytest -q -s -rfEs --tb=short -p no:cacheprovider -m cuda tests/cuda/test_chain_attention_cuda.py \
    -k engine 2>&1 | grep -v "$F" | tail -8
