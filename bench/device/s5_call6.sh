#!/bin/bash
# Device call 6 (session 5, issues 25 and 24): the GRPO step on the Qwen3-1.7B shape (defaults, this session's
# decode kernels and proximal reuse), then the medium workloads and the 12-turn episodes with auto against
# auto-chain-group (chains and groups after a prefix through the fused kernels): may both paths be the default?
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 200 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-1.7b --dtype bfloat16 --modes auto --repeats 2 \
    --json $OUT/grpo_step_1.7b_s5.json 2>&1 | grep -v "$F" | tail -4
timeout -k 5 330 python3 bench/long_trees.py --sections workloads --workloads grpo,agentic,long,tree,episodes \
    --configs auto,auto-chain-group --repeats 1 --max-seconds 300 --out $OUT/long_trees_s5_medium.json 2>&1 \
    | grep -v "$F" | grep "^|\|peak" | tee $OUT/long_trees_s5_medium.log | tail -16
