#!/bin/bash
# Device call 4 (session 5, issues 25 and 23): the GRPO step with this session's decode kernels and the first
# minibatch's proximal reuse (best of 3), then the serving benchmark of issue 23 (64 agents, mixed max_tokens
# 16-512 and temperatures, the short-request probe) in process and served.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 170 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto --repeats 3 \
    --json $OUT/grpo_step_s5.json 2>&1 | grep -v "$F" | tail -4
timeout 280 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 \
    --min-tokens 16 --max-tokens 512 --client-procs 4 --json $OUT/serve_s5.json 2>&1 | grep -v "$F" | tee $OUT/serve_s5.log | tail -14
