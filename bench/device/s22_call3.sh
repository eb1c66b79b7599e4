#!/bin/bash
# Session 22 call 3 (nvidia-h200, ~7.5 min): next_s22.sh's in-process pairs (its served run left out for time; carry [".whl", ".v"]
# (FastAPI and pydantic as wheels: s12_call4.sh). First, here: rm -rf .v && mkdir -p .v/c1 && git archive 180915b src bench | tar -x -C .v/c1
# Session 21's admission bucket rule (while rows decode, prompts join an admission only while its prefill fits a captured
# bucket), c1 = 180915b (before the rule) against this tree, alternating. Predicted (session 21): every prefill call in a
# fixed bucket (was 400-402 of 404-408), tokens/s +1..+3%, probe p99 lower, p50 within +-0.05.
source bench/device/lib.sh
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
for run in 1 2; do
  PYTHONPATH=/tmp/site:.v/c1/src timeout -k 5 110 python3 .v/c1/bench/bench_serve.py $ARGS --modes in-process --json $OUT/c1_$run.json > /tmp/c1_$run.txt 2>&1
  echo "== c1 run $run ($SECONDS s)"; show /tmp/c1_$run.txt | grep -v slowest; grep "fixed buckets\|prefill calls" /tmp/c1_$run.txt | cut -c1-250
  PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 bench/bench_serve.py $ARGS --modes in-process --json $OUT/main_$run.json > /tmp/main_$run.txt 2>&1
  echo "== main run $run ($SECONDS s)"; show /tmp/main_$run.txt | grep -v slowest; grep "fixed buckets\|prefill calls" /tmp/main_$run.txt | cut -c1-250
done
