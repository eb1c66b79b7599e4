#!/bin/bash
# Session 29 call 4 (~3.5 min, H200): the small products alone over their tiles at 16 and 32 rows (the TMA kernels'
# 5 stages were measured at 64 rows only: session 28), then issue 23 in process once if time is left.
source bench/device/lib.sh
export PYTHONPATH=src
echo "== sweep ($SECONDS s)"
timeout -k 5 100 python3 bench/decode_kernels.py --kernels products --product-rows 16,32 --product-sweep \
    --out $OUT/products_sweep_16_32_s29_call4.json > $OUT/sweep.txt 2>&1
grep -v "$F" $OUT/sweep.txt | grep "tail\|Error\|error" | cut -c1-220
[ $SECONDS -lt 110 ] && serve new in-process 85
echo "== done ($SECONDS s)"
