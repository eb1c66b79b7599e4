#!/bin/bash
# Session 31, call 2 (~9 min, H200; carry [".v"]; .v/base = main before the change: git archive 4434c8c src bench).
# The Q/K/V product and the rope kernel as links of the small-row chain (64-128 rows, sm_90+): the product's float32
# partials over QKV_SPLITS ranges summed in the rope kernel, both launched dependent. Call 1's timeline: the two were
# the only launches a layer that waited for the kernel before them (~0.45 us each) and cuBLAS's Q/K/V 5.05 us against
# 2.0 us of weights. Predicted: qkv-rope 7.6 -> 5.5-6.5 us a layer at 64 rows; bench_rollout at 64 rows +2..4%.
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 200 "qkv_link or rope or small or chain" tests/cuda/test_rollout_cuda.py
echo "== products ($SECONDS s)"
timeout -k 5 90 python3 bench/decode_kernels.py --kernels products --product-rows 64,128 \
    --out $OUT/products_s31_call2.json > $OUT/products.txt 2>&1
grep -v "$F" $OUT/products.txt | grep "kernel\|Error\|error" | cut -c1-230
for v in new base new base; do [ $SECONDS -lt 470 ] && { echo "== rollout $v ($SECONDS s)"; rollout $v; }; done
echo "== done ($SECONDS s)"
