#!/bin/bash
# Session 12 call 5 (nvidia-h200): where issue 23's short-request tail (x4.50 p99 in call 4) comes from: the slowest
# probes' start times, at the default prefill chunk between decode steps (8,192 tokens) and at 2,048. carry [".whl"].
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
for c in 8192 2048; do
  PYTHONPATH=/tmp/site:src timeout -k 5 120 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --mixed --probe --repeats 1 --min-tokens 16 --max-tokens 512 --modes in-process --prefill-chunk-tokens $c \
      --json $OUT/serve_mixed_h200_s12_chunk$c.json 2>&1 | grep -v "$F" | tail -5
done
