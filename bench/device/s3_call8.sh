#!/bin/bash
# Device call (session 3, issue 23): the compiled prefill layers on the GPU: the rollout CUDA tests that run it compiled
# (own-prompt rows and groups, prefix cache), then the in-process serve benchmark at the workload.
# Outcome (2026-11-24): with the whole-stack compiled prefill (commit e6dee05, reverted) neither part finished in its
# time limit (no output at all): compilation or recompiles of the 28-layer graph; next: TORCH_LOGS=recompiles on it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 120 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -k "compiled" -p no:cacheprovider -rfE --tb=short 2>&1 \
    | grep -v "$F" | tail -6
timeout 330 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 \
    --modes in-process --json $OUT/serve_inproc_prefill_h100.json 2>&1 | grep -v "$F" | tee $OUT/serve.log | tail -12
