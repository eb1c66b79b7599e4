#!/bin/bash
# Session 16 call 2 (~5 minutes): the kv_copy kernel's CUDA tests alone (call 1's CUDA-test selection ran out of its
# 140 s before reaching them), then next_s16_b.sh's steady-state profile (without its start window: call 1's first
# probe outlier is not in p99).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
# (a fresh machine: the serving wheels first; profile_serve_phases imports bench_serve, which imports the server)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -n "$KV_TESTS" ] && PYTHONPATH=src:tests timeout -k 5 100 python3 -m pytest -q tests/rollout/test_rollout_kv_copy.py -p no:cacheprovider \
    -rfEs --tb=short > $OUT/cuda_kv_copy_tests.txt 2>&1 || true
grep "passed\|failed\|FAILED\|ERROR\|assert\|SKIP" $OUT/cuda_kv_copy_tests.txt | cut -c1-300 | tail -8
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072 --modes in-process"
PYTHONPATH=/tmp/site:src timeout -k 5 200 python3 bench/profile_serve_phases.py --skip 800 --window 600 --profile-json \
    $OUT/serve_phases.json $ARGS > $OUT/serve_phases.txt 2>&1
grep -v "$F" $OUT/serve_phases.txt | grep -v "top_host\|top_kern" | grep -A40 "^window" | cut -c1-180 | head -50
