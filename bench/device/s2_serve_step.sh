#!/bin/bash
# Device call (session 2, issues 23/25): the serve benchmark at the workload (64 agents x 3 turns,
# max_tokens 16-512, mixed temperatures, a short-request probe; 4 client processes), then the 0.6B GRPO step at
# defaults in a fresh process (overlap off: rollout.overlap_forwards=after).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 400 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 \
    --client-procs 4 --json $OUT/serve_mixed512_h100.json 2>&1 | grep -v "$F" | tee $OUT/serve.log | tail -30
timeout 170 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto --overlap after \
    --repeats 2 --json $OUT/grpo_step_after_0.6b.json 2>&1 | grep -v "$F" | tee $OUT/grpo_after.log | tail -8
