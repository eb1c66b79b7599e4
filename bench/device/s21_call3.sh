#!/bin/bash
# Session 21 call 3 (~9.5 min, H200). Carry [".whl", ".v"]: .v/c1 = f7ffd2a (READ_LAG 1: reads of the decode log
# finished one decode step after they start). Call 2: the step's attention is bound by the HBM in the run (128-key
# tiles +20%, 3 stages +0.6%), the rollout CUDA file 37 passed. This call records what main serves now.
# (1) served on main (8 client processes): not measured since READ_LAG = 2 (session 20's call 3 was cut). Predicted
# 10,000-10,800 tok/s (>= 0.9 of in process), probe p50 x2.1-2.4. (2) A second pair c1 / main in process (session 20
# measured +12.1% in one pair). Predicted: main +8..+14%. (3) Issue 25's GRPO step on main (Qwen3-0.6B, 8 x 8,
# prompt 1,024, 512 new, auto, 2 repeats). Predicted 2.1-2.5 s (sessions 12-18: 2.12-2.56 s on H200s).
source bench/device/lib.sh
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=/tmp/site:src timeout -k 5 140 python3 bench/bench_serve.py $ARGS --modes served --client-procs 8 --json $OUT/main_served.json > $OUT/main_served.txt 2>&1
echo "== main served ($SECONDS s)"; show $OUT/main_served.txt | grep -v slowest
PYTHONPATH=/tmp/site:.v/c1/src timeout -k 5 110 python3 .v/c1/bench/bench_serve.py $ARGS --modes in-process --json $OUT/c1_inproc.json > /tmp/c1.txt 2>&1
echo "== c1 in-process ($SECONDS s)"; show /tmp/c1.txt | grep -v slowest
PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 bench/bench_serve.py $ARGS --modes in-process --json $OUT/main_inproc.json > /tmp/main.txt 2>&1
echo "== main in-process ($SECONDS s)"; show /tmp/main.txt | grep -v slowest
PYTHONPATH=src timeout -k 5 $((585 - SECONDS)) python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
    --modes auto --stop-every 0 --repeats 2 --json $OUT/grpo_step.json > $OUT/grpo_step.txt 2>&1
echo "== grpo step ($SECONDS s)"; grep -v "$F" $OUT/grpo_step.txt | tail -6 | cut -c1-200
