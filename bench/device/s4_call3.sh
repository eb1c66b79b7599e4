#!/bin/bash
# Device call 3 (session 4): issue 24's chain attention (bench/device/s4_chain.sh: CUDA tests, long_prefix and
# episodes with the path off / on / flash only, routes counted), then issue 23: the serve benchmark in process with
# prefill pieces of 2,048 tokens (every admission piece then fits a prefill graph bucket) against call 2's 8,192.
bash bench/device/s4_chain.sh
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 140 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 \
    --modes in-process --prefill-chunk-tokens 2048 --json $OUT/serve_chunk2048.json 2>&1 | grep -v "$F" | tail -8
