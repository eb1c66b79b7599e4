#!/bin/bash
# Device call (session 3): the rollout's CUDA tests (tests/cuda/test_rollout_cuda.py: the file the full run of
# s3_cuda_all.sh did not reach in its 10 minutes), then the GRPO step on the Qwen3-1.7B shape at defaults (issue 25).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 330 python3 -m pytest -v -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE --tb=short 2>&1 \
    | grep -v "$F" | grep "PASS\|FAIL\|ERROR\|passed\|failed\|Error" | tee $OUT/cuda_rollout.log | tail -30
timeout 230 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-1.7b --dtype bfloat16 --modes auto --overlap after \
    --repeats 2 --json $OUT/grpo_step_1.7b.json 2>&1 | grep -v "$F" | tee $OUT/grpo17.log | tail -5
