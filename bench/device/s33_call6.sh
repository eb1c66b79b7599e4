#!/bin/bash
# Session 33, call 6 (<= 4 min, H200; carry [".v"]; .v/base = git archive 0c0caa8 src bench). The sampling race's
# loop in fewer instructions, the same bits (sm_90 SASS compiled on the CPU: 856 -> 646 instructions a loop step,
# 107 -> 81 an element): the logs without libdevice's special cases, the flushing exp, the hash's column product
# hoisted, its top bits converted from 32 bits. Predicted: the race -20..-25% (1,024 rows ~0.70 -> ~0.54 ms a step;
# 64 rows ~46 -> ~36 us), bench_rollout at 1,024 rows +1..1.2%, at 64 rows +0.4..0.5% (not timed: device time).
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 75 "race" tests/cuda/test_rollout_cuda.py
for v in new base; do
  d=.; [ $v = base ] && d=.v/base
  echo "== race $v ($SECONDS s)"
  PYTHONPATH=$d/src timeout -k 5 60 python3 $d/bench/decode_kernels.py --kernels race --out $OUT/race_${v}_s33.json 2>&1 \
      | grep -v "$F" | grep "race\|Error" | cut -c1-200
done
for v in new base; do
  echo "== rollout 1,024 rows $v ($SECONDS s)"
  d=.; lim=100; [ $v = base ] && d=.v/base && lim=140
  [ $SECONDS -lt $lim ] && PYTHONPATH=$d/src timeout -k 5 100 python3 $d/bench/bench_rollout.py --device cuda \
      --cases 0.6b:64x16 --extras "" --bandwidth 4.277e12 --out $OUT/rollout1024_${v}_$SECONDS.json 2>&1 \
      | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
done
echo "== done ($SECONDS s)"
