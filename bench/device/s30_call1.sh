#!/bin/bash
# Prepared in session 29 for the next one (~9 min, H200 or H100; carry [".v", ".whl"]; first, here:
#   rm -rf .v && mkdir -p .v/base && git archive 10766c2 src bench | tar -x -C .v/base   (main before the last-tile trim)
# (1) session 29's last change, built after its device time ran out: the split kernel's last tile loads no key past
#     the range's last visible one (~32 of a row's keys a step in blocks of 64). Predicted: bench_rollout at 64 rows
#     +1.5..3%, at 1,024 rows +3..5%; the attention pair at 64 rows x 256 own keys (decode_kernels) -1.5..-2.5 us a
#     layer. The CUDA split/merge/overlap tests on it. (2) issue 23 served, after an in-process run has warmed the
#     compile caches.
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 150 "overlapped or merged or split or paged" tests/cuda/test_rollout_cuda.py
for v in new base new base; do [ $SECONDS -lt 330 ] && { echo "== rollout $v ($SECONDS s)"; rollout $v; }; done
echo "== attention ($SECONDS s)"
timeout -k 5 60 python3 bench/decode_kernels.py --kernels attention --attention-cases 8x8:16,8x8:256,8x8:512,64x16:256 \
    --out $OUT/attention_trim.json > $OUT/attention.txt 2>&1
grep -v "$F" $OUT/attention.txt | grep "kernel\|Error\|error" | cut -c1-230
[ $SECONDS -lt 420 ] && serve new in-process 80
[ $SECONDS -lt 440 ] && serve new served 150
echo "== done ($SECONDS s)"
