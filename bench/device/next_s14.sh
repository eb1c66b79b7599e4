#!/bin/bash
# For the next session (written in session 13; not run: the device time ran out; ~3 minutes, any H100/H200 kind): the serving benchmark after reads of
# the decode log stopped waiting (log_reads.py), in process, 6 turns (compare call 4's serve_mixed_h200_s13_new.json:
# same code before it), then as many CUDA rollout tests as fit. carry [".whl"].
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/site:src timeout -k 5 100 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
    --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --modes in-process \
    --json $OUT/serve_mixed_h200_s13_async_reads.json > $OUT/serve_async_reads.txt 2>&1
grep -v "$F" $OUT/serve_async_reads.txt | grep -v "^  File\|^    \|Traceback" | tail -8 | cut -c1-260
PYTHONPATH=src timeout -k 5 95 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE \
    --tb=short -x > $OUT/rollout_cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/rollout_cuda_tests.txt | cut -c1-300 | tail -6
tail -c 400 $OUT/rollout_cuda_tests.txt
