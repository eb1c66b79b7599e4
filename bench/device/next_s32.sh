#!/bin/bash
# Next session, first call (~8 min, H200; no carry). Session 31's review left two things unrun on a GPU: the CUDA test
# that rope_write rounds the Q/K/V partials' sum to bf16 as the product does (new), and the rollout CUDA tests at
# QKV_SPLITS = 1 with the prompt link only under overlap; then the GRPO step and the 1.7B shape's 64 rows at the new
# defaults (session 29's 1.83 s step predates the chain's Q/K/V link: expected ~-1% of the rollout phase).
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 300 "rope or qkv_link or chain or small_products or split or merged or overlapped" tests/cuda/test_rollout_cuda.py
grpo_steps 330 480 2 new
echo "== 1.7b 64 rows ($SECONDS s)"
[ $SECONDS -lt 470 ] && timeout -k 5 90 python3 bench/bench_rollout.py --device cuda --cases 1.7b:8x8 --extras "" \
    --bandwidth 4.277e12 --out $OUT/rollout_1.7b_next_s32.json 2>&1 | grep -v "$F" | grep "^1.7b\|FAILED\|Error" | cut -c1-200
echo "== done ($SECONDS s)"
