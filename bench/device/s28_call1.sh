#!/bin/bash
# Session 28 call 1 (~9 min, H200; carry [".v", ".whl"]; .v/base = bf0d533, main before the session).
# (1) Nsight Compute on one layer's kernels of the 64-row step (bench/device/ncu_tail.py): where the tail's products
#     and the attention pair stall (if ncu reads counters on this machine's runtime);
# (2) the merged own part's epilogue merging 1/2/3/4 prompt ranges at a time (decode_kernels.py --merge-ranges);
#     predicted at 8x8 (8 prompt ranges): -0.5..-1.5 us a layer at 2-3, none at 64x16 (2 ranges);
# (3) bench_rollout 64 rows new (MERGE_RANGES 2) vs base, two pairs: predicted +1..2%;
# (4) the GPU tests of the change.
source bench/device/lib.sh
export PYTHONPATH=src
echo "== ncu ($SECONDS s)"
which ncu; ncu --version | tail -1
timeout -k 5 150 ncu --clock-control none --profile-from-start off --launch-skip 24 --launch-count 10 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    --section Occupancy --section SchedulerStats python3 bench/device/ncu_tail.py --rows 64 --own 256 \
    > $OUT/ncu_tail_s28_call1.txt 2>&1
echo "rc $?"; grep -c "Duration" $OUT/ncu_tail_s28_call1.txt; grep "==ERR\|==WARN\|rows 64" $OUT/ncu_tail_s28_call1.txt | head -5
grep "^  [_a-z].*(\|Duration\|DRAM Throughput\|Memory Throughput\|Achieved Occupancy\|Registers Per\|Stall\|One or More Eligible" \
    $OUT/ncu_tail_s28_call1.txt | cut -c1-150 | head -90
echo "== merge ranges ($SECONDS s)"
timeout -k 5 120 python3 bench/decode_kernels.py --kernels attention --merge-ranges 1,2,3,4 \
    --attention-cases 8x8:16,8x8:256,8x8:512,64x16:256 --out $OUT/merge_ranges_s28_call1.json > $OUT/merge.txt 2>&1
grep -v "$F" $OUT/merge.txt | grep "attention\|Error\|error" | sed 's/.kernel.: //' | cut -c1-230 | head -40
for v in new base new base; do [ $SECONDS -lt 470 ] && { echo "== rollout $v ($SECONDS s)"; rollout $v; }; done
gpu_tests 80 "chunks_to_the_same_bits or overlapped or merged or small_tail_chain" tests/rollout/test_rollout_paging.py \
    tests/cuda/test_rollout_cuda.py
echo "== done ($SECONDS s)"
