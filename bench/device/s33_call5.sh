#!/bin/bash
# Session 33 call 5 (~7 min, H200; carry [".whl"]). Fresh profiles on main after sessions 31-32's kernels, for the
# next steps of issues 25 and 23: (1) bench_rollout's two shapes at 512 new tokens (kernels by class, the top 20,
# kernels a step); (2) the served step's phases (300 steady steps, in process): device busy against wall a step,
# the split kernel's share, the agents' prefill calls (what a short request behind them waits for).
source bench/device/lib.sh
export PYTHONPATH=src
timeout -k 5 220 python3 bench/profile_rollout.py --cases 0.6b:64x16,0.6b:8x8 --new-tokens 512 \
    --out $OUT/profile_rollout_s33.json > $OUT/profile_rollout_s33.txt 2>&1
grep -v "$F" $OUT/profile_rollout_s33.txt | grep "==\|ms/step\| ms \|Error" | head -60 | cut -c1-170
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=/tmp/site:src timeout -k 5 $((540 - SECONDS)) python3 bench/profile_serve_phases.py --skip 700 --window 300 \
    --profile-json $OUT/phases_s33.json $ARGS --modes in-process > $OUT/phases_s33.txt 2>&1
echo "== phases ($SECONDS s)"; grep -v "$F" $OUT/phases_s33.txt | grep -v "^\s*[0-9.]* ms .*aten" | head -90 | cut -c1-170
