#!/bin/bash
# Session 32, call 4 (~3 min, H200; no carry). After the review of calls 1-3's code: the SiLU gate's CUDA tests with
# the tighter checks (at most one bf16 element in a thousand unlike eager's; the engine's gate calls beyond the
# probe's), the tail's halves sharing _tail's output and down helpers, the pending-logits and graph tests.
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 200 "silu_gate or small_products_in_the_engine or graph_decode or bf16_pending" tests/cuda/test_rollout_cuda.py
echo "== done ($SECONDS s)"
