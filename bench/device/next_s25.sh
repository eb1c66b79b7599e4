#!/bin/bash
# Prepared in session 24 for the next one (~9.5 min, H200 or H100). Carry [".whl", ".v"]; first, here:
#   rm -rf .v && mkdir -p .v/base && git archive 6b00298 src bench | tar -x -C .v/base   (before session 24's decode changes)
# Session 24 measured its decode changes (bf16 pending logits, the race per lane, rope per KV head) with bench_rollout
# only: 1,024 rows +4.7%, 64 rows +0.8% (within the spread). Not measured: (1) the served workload of issue 23 (~62 rows
# a step: the race and rope are ~0.1 ms a step of ~4.2 there, predicted +0..+2% tokens/s, probe p50 unchanged within
# +-0.05), in process, base and main alternating; (2) served on main; (3) if an H100 is lent, bench_rollout's two
# cases there (issue 25's targets are H100 fractions: session 7 measured 0.458 / 0.627 on one).
source bench/device/lib.sh
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
for run in 1 2; do
  PYTHONPATH=/tmp/site:.v/base/src timeout -k 5 110 python3 .v/base/bench/bench_serve.py $ARGS --modes in-process --json $OUT/base_$run.json > /tmp/b_$run.txt 2>&1
  echo "== base run $run ($SECONDS s)"; show /tmp/b_$run.txt | grep -v slowest
  PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 bench/bench_serve.py $ARGS --modes in-process --json $OUT/main_$run.json > /tmp/m_$run.txt 2>&1
  echo "== main run $run ($SECONDS s)"; show /tmp/m_$run.txt | grep -v slowest
done
PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 bench/bench_serve.py $ARGS --modes served --client-procs 8 --json $OUT/main_served.json > $OUT/main_served.txt 2>&1
echo "== main served ($SECONDS s)"; show $OUT/main_served.txt | grep -v slowest
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then
  timeout -k 5 $((585 - SECONDS)) python3 bench/bench_rollout.py --device cuda --cases 0.6b:8x8,0.6b:64x16 --extras "" \
      --bandwidth 3.0e12 --out $OUT/rollout_h100.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED"
fi
