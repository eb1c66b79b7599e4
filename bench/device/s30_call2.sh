#!/bin/bash
# Session 30 call 2 (~7 min, H200; carry [".whl"]). Profiles on main after the last-tile trim (call 1: 64 rows +2.0%):
# (1) bench_rollout's two shapes at 512 new tokens, kernels by class and the top 20 (where the 1,024-row step's
# ~2.9 ms outside attention, matmuls, race, rope and copies goes; the 64-row step's 0.125 ms to 0.50 of the floor);
# (2) the served step's phases (300 steady steps, in process): device busy vs wall, the split kernel's share;
# (3) the race kernel alone (64 / 1,024 rows).
source bench/device/lib.sh
export PYTHONPATH=src
timeout -k 5 200 python3 bench/profile_rollout.py --cases 0.6b:64x16,0.6b:8x8 --new-tokens 512 \
    --out $OUT/profile_rollout.json > $OUT/profile_rollout.txt 2>&1
grep -v "$F" $OUT/profile_rollout.txt | grep "==\|ms/step\| ms \|Error" | head -60 | cut -c1-170
echo "== race ($SECONDS s)"
timeout -k 5 60 python3 bench/decode_kernels.py --kernels race --out $OUT/race.json > $OUT/race.txt 2>&1
grep -v "$F" $OUT/race.txt | grep "kernel\|Error" | cut -c1-200
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=/tmp/site:src timeout -k 5 $((560 - SECONDS)) python3 bench/profile_serve_phases.py --skip 700 --window 300 \
    --profile-json $OUT/phases.json $ARGS --modes in-process > $OUT/phases.txt 2>&1
echo "== phases ($SECONDS s)"; grep -v "$F" $OUT/phases.txt | grep -v "^\s*[0-9.]* ms .*aten" | head -70 | cut -c1-170
