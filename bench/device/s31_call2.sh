#!/bin/bash
# Session 31, call 2 (~9 min, H200; carry [".v"]; .v/base = main before the change: git archive 4434c8c src bench).
# The Q/K/V product, the rope kernel and the prompt part's launch as links of the small-row chain (64-128 rows,
# sm_90+): the product's float32 partials over QKV_SPLITS ranges summed in the rope kernel, each launched dependent
# on the kernel before it. Session 30's timeline: these were the only launches a layer that waited for the kernel
# before them (~0.45 us each, ~39 us a step at 64 rows), and cuBLAS's Q/K/V 5.05 us against 2.0 us of weights.
# Predicted: qkv-rope 7.6 -> 5.5-6.5 us a layer at 64 rows; bench_rollout at 64 rows +2..4%.
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 130 "qkv_link or rope or small_products_in or chain" tests/cuda/test_rollout_cuda.py
echo "== products ($SECONDS s)"
timeout -k 5 90 python3 bench/decode_kernels.py --kernels products --product-rows 64,128 \
    --out $OUT/products_s31_call2.json > $OUT/products.txt 2>&1
grep -v "$F" $OUT/products.txt | grep "kernel\|Error\|error" | grep -v "products-tail" | cut -c1-230
ab() {  # ab NAME "SETTINGS": bench_rollout's 64 rows with blocks' settings patched ("base": main before)
  echo "== rollout $1 ($SECONDS s)"
  if [ "$1" = base ]; then rollout base; return; fi
  with_blocks 90 "$2" bench/bench_rollout.py --device cuda --cases 0.6b:8x8 --extras "" --bandwidth 4.277e12 \
      --out $OUT/rollout_$1_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error\|settings" | cut -c1-200
}
ab new ""; ab base; ab noprompt "PROMPT_LINK=False"
[ $SECONDS -lt 400 ] && ab new ""
[ $SECONDS -lt 440 ] && ab base
echo "== done ($SECONDS s)"
