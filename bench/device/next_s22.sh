#!/bin/bash
# Prepared in session 21 for the next one (~9.5 min, H200). Carry [".whl", ".v"]; first, here:
#   rm -rf .v && mkdir -p .v/c1 && git archive 180915b src bench | tar -x -C .v/c1
# Session 21 built (not measured on a GPU: its device time was spent) the admission's bucket rule: while rows decode,
# prompts join an admission only while its prefill fits a captured bucket. Session 21's profile had 6 of ~404 prefills
# of a served run outside every bucket (an eager forward, ~30-60 ms with every row waiting: 61 ms of device idle in
# one 300-step window). Predicted: "N in fixed buckets" = every prefill call (was 400-402 of 404-408); in process
# tokens/s +1..+3% (the eager prefills' stalls, ~0.2 s of a ~9.6 s run), probe p99 lower, p50 within +-0.05.
# (1) c1 (180915b: before the rule) and main in process, alternating, two runs each; (2) served on main.
source bench/device/lib.sh
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
for run in 1 2; do
  PYTHONPATH=/tmp/site:.v/c1/src timeout -k 5 110 python3 .v/c1/bench/bench_serve.py $ARGS --modes in-process --json $OUT/c1_$run.json > /tmp/c1_$run.txt 2>&1
  echo "== c1 run $run ($SECONDS s)"; show /tmp/c1_$run.txt | grep -v slowest
  PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 bench/bench_serve.py $ARGS --modes in-process --json $OUT/main_$run.json > /tmp/main_$run.txt 2>&1
  echo "== main run $run ($SECONDS s)"; show /tmp/main_$run.txt | grep -v slowest
done
PYTHONPATH=/tmp/site:src timeout -k 5 $((585 - SECONDS)) python3 bench/bench_serve.py $ARGS --modes served --client-procs 8 --json $OUT/main_served.json > $OUT/main_served.txt 2>&1
echo "== main served ($SECONDS s)"; show $OUT/main_served.txt | grep -v slowest
