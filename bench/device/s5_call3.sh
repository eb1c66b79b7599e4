#!/bin/bash
# Device call 3 (session 5, issue 24): groups of leaves after a prefix (GROUPS_AFTER_PREFIX: the prefix's dense
# rectangle through the fused kernels, the own keys through flex with its log-sum-exp, merged): the CUDA tests
# (kernels against float64, then the bf16 engine), then long_prefix with auto / auto-group / auto-chain-group
# (each step's attention layer calls by route, peak memory).
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
T=tests/cuda/test_chain_attention_cuda.py
timeout -k 5 100 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider -m cuda $T -k "not engine" 2>&1 \
    | grep -v "$F" | tee $OUT/chain_cuda_kernels_s5.log | tail -15
echo "pytest (kernels) exit: ${PIPESTATUS[0]}"
timeout -k 5 150 python3 -m pytest -q -s -rfEs --tb=short -p no:cacheprovider -m cuda $T -k engine 2>&1 \
    | grep -v "$F" | tee $OUT/chain_cuda_engine_s5.log | tail -15
echo "pytest (engine) exit: ${PIPESTATUS[0]}"
timeout -k 5 270 python3 bench/long_trees.py --sections workloads --workloads long_prefix \
    --configs auto,auto-group,auto-chain-group --repeats 2 --max-seconds 250 --out $OUT/long_trees_s5_group.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s5_group.log | tail -25
echo "long_trees exit: ${PIPESTATUS[0]}"
