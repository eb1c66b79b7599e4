#!/bin/bash
# Next session's call 2 of 2 (~8 minutes; see next_s10.sh):
# (1) issue 24: episodes, 3 timed steps (session 9's second step took 6.67 s against 5.71 s, unexplained; the row now
#     has the allocator's retries, alloc_retries: one candidate cause);
# (2) the CUDA memory test (long trees within the default budget, both limits) — with ROOT_SPLIT on if call 1 made it
#     the default — and the compiled + recomputed float32 test with kept attentions (did not finish inside session
#     9's 90 s);
# (3) issue 25: the GRPO step (0.6B) with fused AdamW (predicted -12 ms against session 8's 2.44-2.52 s), best of 3.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 100 python3 bench/long_trees.py --sections workloads --workloads episodes --configs auto --repeats 3 \
    --max-seconds 90 --out $OUT/long_trees_s10_episodes.json 2>&1 | grep -v "$F" | grep "^|" | tail -2
timeout -k 5 125 python3 -m pytest -v -s -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "long_trees" 2>&1 | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert\|budget" \
    | cut -c1-600 | tee $OUT/cuda_memory_s10.log | tail -6
timeout -k 5 150 python3 -m pytest -q -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "compiled_and_recomputed and 6-attentions" 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|Error\|assert" \
    | cut -c1-300 | tee $OUT/cuda_kept_s10.log | tail -4
timeout -k 5 150 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto \
    --repeats 3 --json $OUT/grpo_step_s10_fused.json 2>&1 | grep -v "$F" | tail -3
