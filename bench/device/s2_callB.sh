#!/bin/bash
# Device call (session 2): the compiled+recomputed CUDA test's failure (traceback), the chain attention call
# (issue 24: CUDA tests, kernel microbenchmark, long_prefix/episodes with the path on/off), the rollout CUDA tests.
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 100 python3 -m pytest -q -x --tb=short -p no:cacheprovider tests/cuda/test_cuda.py -k "compiled_and_recomputed and all-recomputed-True-packed" 2>&1 | grep -v "$F" | tee $OUT/compiled_fail.log | tail -40
bash bench/device/chain_attention.sh 2>&1 | tee $OUT/chain.log
timeout 130 python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -m cuda tests/rollout 2>&1 | grep -v "$F" | tee $OUT/rollout_cuda.log | tail -15
