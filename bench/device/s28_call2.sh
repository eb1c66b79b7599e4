#!/bin/bash
# Session 28 call 2 (~9 min, H200; carry [".v", ".whl"]; .v/base = bf0d533, main before the session).
# Call 1's Nsight Compute profile: the small products are bound by their own instruction stream (the gated kernel
# ~310 instructions a K step per thread, one warp a scheduler, ~4.7 cycles an instruction; SMs busy half its time).
# Built: their tiles through tensor descriptors (TMA: ~137 instructions a K step). Predicted: the 64-row tail 19.9 ->
# 15-16 us a layer, bench_rollout at 64 rows +4..6%.
# (1) the products' tests on the GPU (TMA and pointers against float64); (2) the tail alone, TMA chain against the
# pointer chain in one process; (3) bench_rollout 64 rows new vs base, two pairs; (4) the CUDA tests of the tail and
# the engine; (5) ncu on the TMA tail; (6) issue 23 in process, one pair.
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 60 "" tests/rollout/test_small_products.py
echo "== tail kernels ($SECONDS s)"
timeout -k 5 90 python3 bench/decode_kernels.py --kernels products --product-rows 16,64,128 \
    --out $OUT/products_s28_call2.json > $OUT/products.txt 2>&1
grep -v "$F" $OUT/products.txt | grep "tail\|Error\|error" | cut -c1-200 | head -14
for v in new base new base; do [ $SECONDS -lt 330 ] && { echo "== rollout $v ($SECONDS s)"; rollout $v; }; done
cp $OUT/tests.txt $OUT/tests_products.txt
gpu_tests 90 "small_tail_chain or small_products" tests/cuda/test_rollout_cuda.py
echo "== ncu ($SECONDS s)"
[ $SECONDS -lt 420 ] && timeout -k 5 70 ncu --clock-control none --profile-from-start off --launch-skip 27 --launch-count 5 \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats --section SchedulerStats \
    python3 bench/device/ncu_tail.py --rows 64 --own 256 > $OUT/ncu_tail_tma_s28_call2.txt 2>&1
grep "^  [_a-z].*(\|Duration\|SM Active\|Elapsed Cycles\|Warp Cycles Per Issued" $OUT/ncu_tail_tma_s28_call2.txt | cut -c1-120 | head -30
[ $SECONDS -lt 440 ] && serve new in-process 75
[ $SECONDS -lt 520 ] && serve base in-process 75
echo "== done ($SECONDS s)"
