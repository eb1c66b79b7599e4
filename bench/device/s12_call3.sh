#!/bin/bash
# Session 12 call 3 (nvidia-h200), main with the merged decode attention: where the three issues stand on this device.
# Issue 23: the short request behind 64 agents (in process). Issue 25: the GRPO step (0.6B). Issue 24: the medium shapes
# at this device's defaults (25% of 140 GiB) and at the H100's budget (0.141 x 140.4 GiB = 19.8 GiB), with a profile
# of grpo's step at the H100's budget.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout -k 5 150 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe \
    --repeats 1 --min-tokens 16 --max-tokens 512 --modes in-process --json $OUT/serve_mixed_h200_s12.json 2>&1 \
    | grep -v "$F" | tail -5
timeout -k 5 160 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto \
    --repeats 3 --json $OUT/grpo_step_h200_s12.json 2>&1 | grep -v "$F" | tail -3
timeout -k 5 250 python3 bench/profile_engine.py --device cuda --shape qwen3-1.7b --workloads grpo,agentic \
    --configs auto-b0.141,auto --profile grpo:auto-b0.141 --out $OUT 2>&1 | grep -v "$F" | tail -14
