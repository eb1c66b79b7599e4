#!/bin/bash
# Session 31, call 1 (~9 min, H200; carry [".whl"]). (1) The decode step in place (bench/decode_in_situ.py, new): at
# 1,024 rows the profile's split kernels take ~11.2 ms a step against ~8.5 ms of the bytes they read at 4.28 TB/s,
# while decode_kernels' synthetic pair (every row 256 keys) runs at 98% of that rate. Is the in-place attention slower
# (spans by admission wave, the allocator's blocks, the own-slot bucket), or is the profile's figure something else?
# (2) the synthetic pair in the same call; (3) session 30's remaining CUDA rollout tests at PROMPT_PROGRAMS 264 (trees,
# forks, preemption); (4) the 1.7B shape's 64 rows at 264 against 528, as time allows.
source bench/device/lib.sh
export PYTHONPATH=src
echo "== in situ ($SECONDS s)"
timeout -k 5 220 python3 bench/decode_in_situ.py --cases 0.6b:64x16,0.6b:8x8 --out $OUT/in_situ_s31_call1.json \
    > $OUT/in_situ.txt 2>&1
grep -v "$F" $OUT/in_situ.txt | cut -c1-420 | tail -14
echo "== attention synthetic ($SECONDS s)"
timeout -k 5 60 python3 bench/decode_kernels.py --kernels attention --attention-cases 8x8:256,64x16:256,64x16:128 \
    --out $OUT/attention_s31_call1.json > $OUT/attention.txt 2>&1
grep -v "$F" $OUT/attention.txt | grep "kernel\|Error\|error" | cut -c1-230
gpu_tests 170 "not overlapped and not merged and not graph_decode and not bf16" tests/cuda/test_rollout_cuda.py
for t in 264 528; do
  [ $SECONDS -lt 460 ] && { echo "== 1.7b 64 rows, $t ($SECONDS s)"; patched 100 $t bench/bench_rollout.py --device cuda \
      --cases 1.7b:8x8 --extras "" --bandwidth 4.277e12 2>&1 | grep -v "$F" | grep "^1.7b\|FAILED\|Error\|prompt part" | cut -c1-200; }
done
echo "== done ($SECONDS s)"
