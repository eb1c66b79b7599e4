#!/bin/bash
# Session 8, device call 5 (diagnosis): (1) AdamW's step, default (foreach) against fused, 0.6B and 1.7B; (2) issue 24:
# long_prefix and episodes with every recomputed layer keeping its attention (auto-keepall: what the memory model's
# margin costs in time, and the true peak); (3) issue 25: the GRPO step's update split into engine calls and
# optimizer steps (--split-update).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 80 python3 bench/adamw_step.py --out $OUT/adamw_s8.json 2>&1 | grep -v "$F" | tail -4
timeout -k 5 230 python3 bench/long_trees.py --sections workloads --workloads long_prefix,episodes \
    --configs auto,auto-keepall --repeats 2 --max-seconds 215 --out $OUT/long_trees_s8_keepall.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s8_keepall.log | grep "^|" | tail -6
timeout -k 5 170 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto \
    --repeats 2 --split-update --json $OUT/grpo_step_s8_split.json 2>&1 | grep -v "$F" | tail -3
python3 -c "
import json; d=json.load(open('$OUT/grpo_step_s8_split.json'))
for k, m in d.items(): print(k, {x: round(v, 3) for x, v in m.items() if x.startswith('time/')})"
