#!/bin/bash
# Session 8, device call 4: (1) the CUDA tests of host syncs per segment (the one pass uploads its sequence-end indices
# once) and of exactness (chained plans, separable and not); (2) issue 25's GRPO step (0.6B), the bench's fixed
# engine.max_tokens=16384 against the engine's default (the memory budget), best of 3 each.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 150 python3 -m pytest -q -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "no_host_sync or (flex_float32 and (dfs or auto))" 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|Error\|assert" \
    | cut -c1-300 | tee $OUT/cuda_sync_s8.log | tail -6
for mt in 16384 null; do
  timeout -k 5 190 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto \
      --repeats 3 --set engine.max_tokens=$mt --json $OUT/grpo_step_s8_mt_$mt.json 2>&1 | grep -v "$F" | tail -3
done
