#!/bin/bash
# Next session, first call (~6 min, H200; carry [".v"] with .v/base = git archive 0c0caa8 src bench: main before
# session 33's race change). Session 33 timed the race alone (-19.6% at 64 rows, -21.4% at 1,024) and bench_rollout
# at 1,024 rows (+1.0%), not the 64-row rollout: predicted +0.4..0.5% (-9 us of a ~1.92 ms step), ~0.49 of the floor.
# Alternating processes, then the GRPO step at the defaults for a fresh status.
# First the race's CUDA tests: the noise bit test as the review extended it (the hash's low bits set too; not yet
# run on a GPU).
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 75 "race" tests/cuda/test_rollout_cuda.py
for v in new base new base; do
  [ $SECONDS -lt 300 ] && echo "== rollout 64 rows $v ($SECONDS s)" && rollout $v
done
grpo_steps 330 460 2 new
echo "== done ($SECONDS s)"
