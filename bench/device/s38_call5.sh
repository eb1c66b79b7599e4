#!/bin/bash
# Session 38, call 5 (~5 min, H200; carry [".whl"]): the short request's ratio against the agents' context length.
# Issue 23's benchmark (64 agents, max_tokens 16-512, mixed temperatures) at 3 turns (session 2's workload: shorter
# contexts, fewer K/V bytes a step) beside call 2's 6 turns. Predicted: the ratio falls with the step's bytes
# (x2.18 served / x2.43 in process at 6 turns; ~x1.8-2.0 at 3 turns).
source bench/device/lib.sh
export PYTHONPATH=src
for m in in-process served; do
  echo "== $m, 3 turns ($SECONDS s)"
  PYTHONPATH=/tmp/site:src timeout -k 5 200 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b \
      --dtype bfloat16 --mixed --probe --repeats 1 --turns 3 --min-tokens 16 --max-tokens 512 \
      --prefix-cache-tokens 131072 --modes $m --client-procs 8 --json $OUT/serve_t3_${m}_s38.json > $OUT/serve_t3_${m}_s38.txt 2>&1
  show $OUT/serve_t3_${m}_s38.txt | grep -v slowest
  grep "decode steps" $OUT/serve_t3_${m}_s38.txt | cut -c1-250
done
echo "== done ($SECONDS s)"
