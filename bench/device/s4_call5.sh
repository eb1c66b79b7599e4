#!/bin/bash
# Device call 5 (session 4): the rollout's CUDA tests, whole file (prefill graphs, the shared qkv_rope, the capture
# helper), then where long_prefix's step goes with the chain attention on (torch profiler; call 4's run of both
# settings did not fit its time).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 290 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE --tb=short 2>&1 \
    | grep -v "$F" | grep "passed\|failed\|FAIL\|Error\|error" | tee $OUT/cuda_rollout_s4.log | tail -12
mkdir -p $OUT/prof
timeout 260 python3 bench/profile_long_prefix.py --chain on --out $OUT/prof 2>&1 | grep -v "$F" | tee $OUT/long_prefix_profile.log | cut -c1-200 | head -80
