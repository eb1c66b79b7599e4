#!/bin/bash
# Session 28 call 4 (~6.5 min, H200; carry [".v", ".whl"]; .v/base = bf0d533): the TMA products at 5 stages (call 3's
# sweep at 64 rows: each product -0.2..-0.3 us against 4 stages). Predicted: the 64-row tail 18.2-18.6 -> ~17.6 us a
# layer; bench_rollout at 64 rows +2.5..3% against base (call 2, 4 stages: +1.9%). Then the GRPO step and issue 23 in
# process, new only (call 2 has the in-process pair at 4 stages).
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 60 "" tests/rollout/test_small_products.py
echo "== tail kernels ($SECONDS s)"
timeout -k 5 60 python3 bench/decode_kernels.py --kernels products --product-rows 64,128 \
    --out $OUT/products_s28_call4.json > $OUT/products.txt 2>&1
grep -v "$F" $OUT/products.txt | grep "tail\|Error\|error" | cut -c1-200 | head -10
for v in new base new base; do [ $SECONDS -lt 230 ] && { echo "== rollout $v ($SECONDS s)"; rollout $v; }; done
grpo_steps 260 345 2 new
[ $SECONDS -lt 350 ] && serve new in-process 75
echo "== done ($SECONDS s)"
