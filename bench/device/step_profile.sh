#!/bin/bash
# Device call (issue 25, baseline): the GRPO step's rollout alone / back to back / inside the step,
# the per-phase step, and the decode profile at 64 rows.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout 240 python3 bench/profile_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --out $OUT/step_profile.json 2>&1 | grep -v "Warning\|warn\|USDT" | tee $OUT/step_profile.log | tail -40
timeout 150 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --repeats 2 --json $OUT/grpo.json 2>&1 | grep -v "Warning\|warn\|softmax\|^\s*$" | tail -5
timeout 120 python3 bench/profile_rollout.py --cases 0.6b:8x8 --new-tokens 128 --out $OUT/profile_rollout.json 2>&1 | grep -v "Warning\|warn\|USDT" | tail -14
