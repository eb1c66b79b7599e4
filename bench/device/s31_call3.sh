#!/bin/bash
# Session 31, call 3 (~5 min, H200; carry [".v"]; .v/base = git archive 4434c8c src bench). Call 2's kernel bench put
# the linked Q/K/V product + rope at 1 range (7.08 us a layer at 64 rows) ahead of 2 (8.49) and in turn (8.35); the
# default is now 1. The CUDA link test at 1 range, then bench_rollout's 64 rows new/base twice.
# Predicted: +1..2% at 64 rows (-1.3 us a layer x 28 layers of a ~2.0 ms step).
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 90 "qkv_link" tests/cuda/test_rollout_cuda.py
for v in new base new base; do
  echo "== rollout $v ($SECONDS s)"
  [ $SECONDS -lt 330 ] && rollout $v
done
echo "== done ($SECONDS s)"
