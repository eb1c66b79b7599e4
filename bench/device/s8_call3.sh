#!/bin/bash
# Session 8, device call 3: (1) issue 24, the same-process baseline of the one pass: episodes with `auto` (separable:
# the one pass) and `auto-general` (the same loss not declared separable: two phases, which is exactly what a
# separable loss ran before on trees with no standalone segment, as episodes' two trees); (2) issue 25, the GRPO step
# (0.6B) at this session's defaults, best of 3; (3) the rollout CUDA tests (the kernel probes' refactor f8c8b18).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 195 python3 bench/long_trees.py --sections workloads --workloads episodes --configs auto,auto-general \
    --repeats 2 --max-seconds 185 --out $OUT/long_trees_s8_general.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s8_general.log | grep "^|\|non-separable" | tail -5
timeout -k 5 195 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto \
    --repeats 3 --json $OUT/grpo_step_s8.json 2>&1 | grep -v "$F" | tail -6
timeout -k 5 175 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE --tb=short 2>&1 \
    | grep "passed\|failed\|FAILED\|ERROR\|Error" | cut -c1-300 | tee $OUT/cuda_rollout_s8.log | tail -6
