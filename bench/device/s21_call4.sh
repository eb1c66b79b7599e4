#!/bin/bash
# Session 21 call 4 (~5 min, H200). Carry [".whl"]. (1) Issue 25's second shape: the GRPO step at Qwen3-1.7B on main
# (8 x 8, prompt 1,024, 512 new, auto; H100 session 3: 4.06 s). Predicted 2.6-3.2 s (the 0.6B step went 3.75 s on the
# H100 to 2.11 s here). (2) Served on main again (call 3: 10,055 tok/s, probe p50 x2.14): the spread of one figure.
source bench/device/lib.sh
PYTHONPATH=src timeout -k 5 170 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-1.7b --dtype bfloat16 \
    --modes auto --stop-every 0 --repeats 2 --json $OUT/grpo_step_1.7b.json > $OUT/grpo_step_1.7b.txt 2>&1
echo "== grpo step 1.7b ($SECONDS s)"; grep -v "$F" $OUT/grpo_step_1.7b.txt | tail -4 | cut -c1-200
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=/tmp/site:src timeout -k 5 $((300 - SECONDS)) python3 bench/bench_serve.py $ARGS --modes served --client-procs 8 --json $OUT/main_served.json > $OUT/main_served.txt 2>&1
echo "== main served ($SECONDS s)"; show $OUT/main_served.txt | grep -v slowest
