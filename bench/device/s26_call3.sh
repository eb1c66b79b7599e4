#!/bin/bash
# Session 26 call 3 (~8 min, H200; carry [".v", ".whl"]): issue 23's workload (64 agents x 6 turns, max_tokens 16-512,
# Qwen3-0.6B bf16, prefix cache 131,072) with the small-row products, in process against main (.v/base = f5af947),
# and served (8 client processes); then the 64-row decode step profiled with them.
# Predicted: the served step's tail at 56-64 rows -5.7 us a layer (call 1's kernel bench), ~-0.16 ms of a ~4.1 ms
# step: in process +3..4% tokens/s, the short request's p50 ratio x2.3-2.4 -> ~x2.25; served x2.14 -> ~x2.05.
source bench/device/lib.sh
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
serve() {  # serve VERSION MODE LIMIT
  local d=.; [ $1 = base ] && d=.v/base
  PYTHONPATH=/tmp/site:$d/src timeout -k 5 $3 python3 $d/bench/bench_serve.py $ARGS --modes $2 --client-procs 8 \
      --json $OUT/serve_$1_$2_$SECONDS.json > $OUT/serve_$1_$2.txt 2>&1
  echo "== $1 $2 ($SECONDS s)"; show $OUT/serve_$1_$2.txt | grep -v slowest
}
serve new in-process 110
serve base in-process 110
[ $SECONDS -lt 300 ] && serve new served $((470 - SECONDS))
if [ $SECONDS -lt 480 ]; then
  echo "== profile 64 rows ($SECONDS s)"
  PYTHONPATH=src timeout -k 5 $((585 - SECONDS)) python3 bench/profile_rollout.py --cases 0.6b:8x8 --new-tokens 512 \
      --out $OUT/profile_rollout_64.json 2>&1 | grep -v "$F" | grep "==\|ms/step\| ms \|Error" | head -30 | cut -c1-160
fi
echo "== done ($SECONDS s)"
