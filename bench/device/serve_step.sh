#!/bin/bash
# Device call (issues 23, 25): serve deps from .whl, the mixed-settings serve benchmark, the GRPO step A/B
# of rollout.keep_stream_buffers (auto only).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|softmax\|Inductor\|important use\|^\s*$"
timeout 300 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --json $OUT/serve_mixed_h100.json 2>&1 | grep -v "$F" | tail -25
for keep in false true; do
timeout 130 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --repeats 2 --modes auto --set rollout.keep_stream_buffers=$keep --json $OUT/grpo_keep_$keep.json 2>&1 | grep -v "$F" | tail -2
done
