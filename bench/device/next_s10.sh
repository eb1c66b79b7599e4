#!/bin/bash
# For the next session with device time (written in session 9, whose ~11 minutes went to measuring session 8's
# margin: bench/device/s9_call1.sh). What is left unmeasured, most needed first (~9 minutes; one call):
#   scripts/get_dta.sh here first (fetch github:Whisper-6/DynamicTreeAttn), then run with carry [".dta"].
# (1) issue 24: long_prefix and episodes against the DTA authors' engine in one process at today's defaults (the
#     margin: long_prefix 3.05 s; session 8's same-call ratio 2.08x was before it), 2 steps each;
# (2) issue 24: episodes, 3 timed steps (session 9's second step took 6.67 s against 5.71 s, unexplained; the row now
#     has the allocator's retries, alloc_retries: one candidate cause);
# (3) the compiled + recomputed float32 CUDA test with kept attentions (did not finish inside session 9's 90 s);
# (4) issue 25: the GRPO step (0.6B) with fused AdamW (predicted -12 ms against session 8's 2.44-2.52 s), best of 3.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
MAX_S=170 timeout -k 5 190 bash bench/device/dta_compare.sh --shapes long_prefix,episodes --engines auto,dta \
    --no-grad-check --repeats 2 2>&1 | tail -8
timeout -k 5 100 python3 bench/long_trees.py --sections workloads --workloads episodes --configs auto --repeats 3 \
    --max-seconds 90 --out $OUT/long_trees_s10_episodes.json 2>&1 | grep -v "$F" | grep "^|" | tail -2
timeout -k 5 150 python3 -m pytest -q -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "compiled_and_recomputed and 6-attentions" 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|Error\|assert" \
    | cut -c1-300 | tee $OUT/cuda_kept_s10.log | tail -4
timeout -k 5 150 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto \
    --repeats 3 --json $OUT/grpo_step_s10_fused.json 2>&1 | grep -v "$F" | tail -3
