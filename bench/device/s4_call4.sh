#!/bin/bash
# Device call 4 (session 4): issue 23, the served path after the server's host-time changes (TCP_NODELAY, fewer GIL
# handoffs, incremental detokenization) with prefill graphs: the serve benchmark, both modes; issue 24, where
# long_prefix's step goes (torch profiler, chain path off and on); issue 25, where the GRPO step's rollout goes
# (GPU busy against wall, top host ops; kept buffers).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 250 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 \
    --client-procs 4 --json $OUT/serve_after.json 2>&1 | grep -v "$F" | tee $OUT/serve_after.log | tail -12
mkdir -p $OUT/prof
timeout 170 python3 bench/profile_long_prefix.py --out $OUT/prof 2>&1 | grep -v "$F" | tee $OUT/long_prefix_profile.log | cut -c1-220 | head -90
timeout 130 python3 bench/profile_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --keep-buffers 1 \
    --out $OUT/step_profile.json 2>&1 | grep -v "$F" | tail -40
