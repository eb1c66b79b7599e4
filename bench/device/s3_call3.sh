#!/bin/bash
# Device call 3 (session 3, issue 23): the split kernel's CUDA tests (hidden tiles skipped), then the serve benchmark
# at the workload (64 agents x 3 turns, max_tokens 16-512, mixed temperatures, short-request probe, 4 client
# processes) with the new kernel, and one more in-process run under the torch profiler (device busy vs wall).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 150 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -k "split_kernel or two_level or kept_buffers" \
    -p no:cacheprovider -rfE --tb=short 2>&1 | grep -v "$F" | tail -8
timeout 420 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 \
    --client-procs 4 --profile --json $OUT/serve_mixed512_skip_h100.json 2>&1 | grep -v "$F" | tee $OUT/serve.log | tail -45
