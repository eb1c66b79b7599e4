#!/bin/bash
# Session 24, call 2 (~8 min): issue 25's decode step at 1,024 rows outside its attention: the sampling race per lane
# (no reduction per block), the pending logits in the head's bf16 written by its own product (no float32 copy),
# the rope kernel one program per (row, KV head). Carry [".v"] (.v/base: git archive 6b00298 src bench).
source bench/device/lib.sh
PYTHONPATH=src:tests timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider -W ignore tests/rollout/test_race_kernel.py \
    tests/rollout/test_rope_kernel.py tests/cuda/test_rollout_cuda.py \
    -k "race or rope or graph_decode_matches or stream_matches_eager or per_group or graph_trees" 2>&1 \
    | grep -v "$F" | grep "FAILED\|passed\|failed\|Error" | cut -c1-300 | tail -8
echo "== kernels ($SECONDS s)"
for v in base new; do
  s=src; [ $v = base ] && s=.v/base/src
  # (ran as bench/race_kernel.py and bench/rope_kernel.py, merged after the session into bench/decode_kernels.py)
  PYTHONPATH=$s timeout -k 5 120 python3 bench/decode_kernels.py --out $OUT/decode_kernels_$v.json 2>&1 | grep "rows" \
      | sed "s/^/$v /"
done
for v in base new base new; do
  d=.; [ $v = base ] && d=.v/base
  [ $SECONDS -gt 420 ] && break
  echo "== rollout $v ($SECONDS s)"
  timeout -k 5 110 python3 $d/bench/bench_rollout.py --device cuda --cases 0.6b:8x8,0.6b:64x16 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_${v}_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED" | cut -c1-200
done
echo "== profile ($SECONDS s)"
PYTHONPATH=src timeout -k 5 $((575 - SECONDS)) python3 bench/profile_rollout.py --cases 0.6b:64x16,0.6b:8x8 --new-tokens 512 \
    --out $OUT/profile_rollout_new.json 2>&1 | grep -v "$F" | grep "==\|ms/step\| ms " | head -40 | cut -c1-160
