#!/bin/bash
# Session 32, call 2 (~9 min, H200; carry [".v"]; .v/base = git archive 8cf4eae src bench). The SiLU gate above
# MAX_ROWS rows through its own kernel (rollout/silu_gate.py) between the tail's compiled halves, against inductor's
# fused kernel inside the compiled tail (session 30's timeline: 11.7 us a layer at 1,024 rows for 18.9 MB).
# Predicted: the gate alone 11.7 -> 5.5-6.5 us a layer; the 1,024-row tail -5..-6 us a layer; bench_rollout's 1,024
# rows +1..1.5% (-0.15 ms of a ~14 ms step); 64 rows unchanged (the small-row kernels serve them).
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 150 "silu_gate or small_products_in_the_engine" tests/cuda/test_rollout_cuda.py
echo "== products ($SECONDS s)"
timeout -k 5 120 python3 bench/decode_kernels.py --kernels products --product-rows 64,256,1024 \
    --out $OUT/products_s32_call2.json 2>&1 | grep -v "$F" | grep "silu\|tail\|Error" | cut -c1-200
for v in new base new base; do
  echo "== rollout 1,024 rows $v ($SECONDS s)"
  d=.; [ $v = base ] && d=.v/base
  [ $SECONDS -lt 450 ] && PYTHONPATH=$d/src timeout -k 5 100 python3 $d/bench/bench_rollout.py --device cuda \
      --cases 0.6b:64x16 --extras "" --bandwidth 4.277e12 --out $OUT/rollout1024_${v}_$SECONDS.json 2>&1 \
      | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
done
echo "== done ($SECONDS s)"
