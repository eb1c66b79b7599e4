#!/bin/bash
# Session 27 call 2 (~8 min, H200; carry [".v", ".whl"]; .v/base = ad21e5f): the chain without the weight prefetch
# (call 1/1b: no change from it) and only from 64 rows (CHAIN_MIN_ROWS; call 1: slower at 16 rows in the kernel
# bench). (1) its GPU tests; (2) the tail alone at 16/32/64/128 rows; (3) bench_rollout 64 rows new vs base, two
# pairs; (4) issue 23 in process new vs base. Predicted: the 64-row rollout +1.5..2% (call 1: +1.7%), the tail at 64
# rows ~19.3 us a layer; in process +0..2% tokens/s (the served batch is at most 64 rows, ~44 live).
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 120 "small_tail_chain or small_products_in_the_engine" tests/cuda/test_rollout_cuda.py
echo "== tail kernels ($SECONDS s)"
timeout -k 5 80 python3 bench/decode_kernels.py --kernels products --product-rows 16,32,64,128 \
    --out $OUT/products_s27_call2.json > $OUT/products.txt 2>&1
grep -v "$F" $OUT/products.txt | grep "tail\|Error\|error" | cut -c1-200 | head -14
for v in new base new base; do echo "== rollout $v ($SECONDS s)"; rollout $v; done
[ $SECONDS -lt 330 ] && serve new in-process 75
[ $SECONDS -lt 410 ] && serve base in-process 75
echo "== done ($SECONDS s)"
