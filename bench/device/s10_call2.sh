#!/bin/bash
# Session 10, call 2: (1) issue 24: what a lone recomputing call really holds per kept attention, root split on
# and off (bench/device/kept_slope.py: call 1's root split kept 16 layers and peaked 2.7 GiB over the budget);
# (2) next_s10_b.sh without its memory test (episodes x3, the kept-attention compiled test, the GRPO step with
# fused AdamW). The memory test runs in call 3, after the margin's fix, with the root split on.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 150 python3 bench/device/kept_slope.py 2>&1 | grep -v "$F" | tee $OUT/kept_slope_s10.log | cut -c1-700
timeout -k 5 100 python3 bench/long_trees.py --sections workloads --workloads episodes --configs auto --repeats 3 \
    --max-seconds 90 --out $OUT/long_trees_s10_episodes.json 2>&1 | grep -v "$F" | grep "^|" | tail -2
timeout -k 5 120 python3 -m pytest -q -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "compiled_and_recomputed and 6-attentions" 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|Error\|assert" \
    | cut -c1-300 | tee $OUT/cuda_kept_s10.log | tail -4
timeout -k 5 130 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto \
    --repeats 3 --json $OUT/grpo_step_s10_fused.json 2>&1 | grep -v "$F" | tail -3
