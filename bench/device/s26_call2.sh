#!/bin/bash
# Session 26 call 2 (~9.5 min, H200; carry [".v", ".whl"]): the small-row products with call 1's tiles (4 stages, the
# gated kernel in 32-column tiles) and the Q/K/V product back on cuBLAS, against main (.v/base = f5af947):
# (1) their GPU tests (output kept whole); (2) bench_rollout 8x8 (64 rows), alternating; (3) issue 23's workload in
# process; (4) the GRPO step (new only, if time remains) 
# Predicted: 64 rows 29.1k (call 1) -> 29.5-30.0k tok/s (Q/K/V on cuBLAS -0.024 ms, the tiles -0.03 ms a step);
# the GRPO step 2.06 -> ~1.99 s (rollout -0.07 s); in process: the tail at 56-64 rows -5.7 us a layer, ~-0.16 ms of
# a ~4.1 ms step: +3..4% tokens/s, the short request's p50 ratio x2.3-2.4 -> ~x2.25.
source bench/device/lib.sh
export PYTHONPATH=src
echo "== tests ($SECONDS s)"
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_small_products.py \
    tests/cuda/test_rollout_cuda.py -k "small or overlapped_decode_attention_in" > $OUT/tests.txt 2>&1
grep "^E \|passed\|failed\|^FAILED" $OUT/tests.txt | head -20 | cut -c1-250
for v in new base; do echo "== rollout $v ($SECONDS s)"; rollout $v; done
serve new in-process 110
serve base in-process 110
grpo_steps 470 590 1 new
echo "== done ($SECONDS s)"
