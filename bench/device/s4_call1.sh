#!/bin/bash
# Device call 1 (session 4): issue 24 item 4 (the first forward_backward of a process: cold, warm cache, artifacts
# only; never measured on the GPU before), then issue 25's update phase against the memory budget (does the 0.6B
# GRPO step's update recompute blocks it has room not to?).
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 300 python3 bench/first_step.py --out $OUT/first_step_h100.json 2>&1 | grep -v "$F" | tail -25
A="--device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto --overlap after --repeats 2"
for b in 0.2 0.5; do
  timeout 130 python3 bench/bench_grpo_step.py $A --set engine.memory_budget=$b --json $OUT/grpo_budget_$b.json 2>&1 \
    | grep -v "$F" | tail -3
done
