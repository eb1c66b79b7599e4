#!/bin/bash
# Session 27 call 1 (~9.5 min, H200; carry [".v", ".whl"]; .v/base = main before the session, ad21e5f): the small-row
# tail as a chain of dependent launches (each link lets the next start, prefetches its weight slice into the L2,
# then waits; the own part's attention lets the tail's first product start).
# (1) its GPU tests; (2) the tail alone over 28 layers' weights (cuBLAS / small / small-chain); (3) bench_rollout 64
# rows new vs base, alternating, two pairs; (4) the GRPO step (new); (5) issue 23 in process new vs base if time remains.
# Predicted: the tail at 64 rows 21.6 -> 15-18 us a layer; the 64-row rollout 29.6k -> 31-32.5k tok/s (0.455-0.48).
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 150 small tests/rollout/test_small_products.py tests/cuda/test_rollout_cuda.py
echo "== tail kernels ($SECONDS s)"
timeout -k 5 100 python3 bench/decode_kernels.py --kernels products --product-rows 16,64,128 \
    --out $OUT/products_s27_call1.json > $OUT/products.txt 2>&1
grep -v "$F" $OUT/products.txt | grep "tail\|Error\|error" | cut -c1-220 | head -12
for v in new base new base; do echo "== rollout $v ($SECONDS s)"; rollout $v; done
grpo_steps 420 520 1 new
[ $SECONDS -lt 430 ] && serve new in-process 80
echo "== done ($SECONDS s)"
