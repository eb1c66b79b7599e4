#!/bin/bash
# Session 26 call 2 (~9.5 min, H200; carry [".v", ".whl"]): the small-row products with call 1's tiles (4 stages, the
# gated kernel in 32-column tiles) and the Q/K/V product back on cuBLAS, against main (.v/base = f5af947):
# (1) their GPU tests (output kept whole); (2) bench_rollout 8x8 (64 rows), alternating; (3) issue 23's workload in
# process; (4) the GRPO step (new only, if time remains) 
# Predicted: 64 rows 29.1k (call 1) -> 29.5-30.0k tok/s (Q/K/V on cuBLAS -0.024 ms, the tiles -0.03 ms a step);
# the GRPO step 2.06 -> ~1.99 s (rollout -0.07 s); in process: the tail at 56-64 rows -5.7 us a layer, ~-0.16 ms of
# a ~4.1 ms step: +3..4% tokens/s, the short request's p50 ratio x2.3-2.4 -> ~x2.25.
source bench/device/lib.sh
export PYTHONPATH=src
echo "== tests ($SECONDS s)"
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_small_products.py \
    tests/cuda/test_rollout_cuda.py -k "small or overlapped_decode_attention_in" > $OUT/tests.txt 2>&1
grep "^E \|passed\|failed\|^FAILED" $OUT/tests.txt | head -20 | cut -c1-250
rollout() {  # rollout VERSION
  local d=.; [ $1 = base ] && d=.v/base
  PYTHONPATH=$d/src timeout -k 5 90 python3 $d/bench/bench_rollout.py --device cuda --cases 0.6b:8x8 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_$1_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
}
for v in new base; do echo "== rollout $v ($SECONDS s)"; rollout $v; done
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
serve() {  # serve VERSION MODE LIMIT
  local d=.; [ $1 = base ] && d=.v/base
  PYTHONPATH=/tmp/site:$d/src timeout -k 5 $3 python3 $d/bench/bench_serve.py $ARGS --modes $2 --client-procs 8 \
      --json $OUT/serve_$1_$2_$SECONDS.json > $OUT/serve_$1_$2.txt 2>&1
  echo "== $1 $2 ($SECONDS s)"; show $OUT/serve_$1_$2.txt | grep -v slowest
}
serve new in-process 110
serve base in-process 110
grpo_steps 470 590 1 new
echo "== done ($SECONDS s)"
