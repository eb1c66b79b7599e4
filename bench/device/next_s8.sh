#!/bin/bash
# For the next session with device time (written in session 7, whose device time ran out): settle what session 7
# measured only once. (1) The six shapes at the defaults (25% budget, balanced packs) with 3 timed steps each: GRPO's
# one step of call 11 (1.867 s) against the same plan's 1.555 s in call 9 is unexplained. (2) The GRPO step of issue 25
# (0.6B) with the bounded split kernel and issue 24's defaults (its update's plans may have changed), best of 3.
# ~9 minutes; run as one call:  bash bench/device/next_s8.sh
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -k 5 330 python3 bench/long_trees.py --sections workloads --workloads grpo,agentic,long,tree,long_prefix,episodes \
    --configs auto --repeats 3 --max-seconds 300 --out $OUT/long_trees_s8_defaults.json 2>&1 | grep "^|" | tail -10
timeout -k 5 200 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto --repeats 3 \
    --json $OUT/grpo_step_s8.json 2>&1 | grep -v "Warning\|warn\|^\s*$" | tail -4
