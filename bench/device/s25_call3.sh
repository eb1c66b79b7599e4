#!/bin/bash
# Session 25, call 3 (~8 min). Carry [".v"]; first, here:
#   rm -rf .v && mkdir -p .v/base && git archive 508e2d7 src bench | tar -x -C .v/base   (calls 1-2's overlap: own <- prompt)
# New here: the rope kernel lets the prompt part start beside it (the prompt part reads its mask, then waits before
# reading q), predicted -1..-3 us a layer at 64 rows (-0.03..-0.08 ms a step); the pair's bench over 28 layers' own
# buffers (call 2's single-layer replays kept the 64-row case's K/V in the L2, and disagreed with bench_rollout on the
# prompt part's programs). The CUDA tests of the decode paths, bench_rollout new/base, the 64-row profile.
source bench/device/lib.sh
echo "== cuda tests ($SECONDS s)"
PYTHONPATH=src timeout -k 5 230 python3 -m pytest -q -p no:cacheprovider -W ignore tests/cuda/test_rollout_cuda.py \
    -k "overlap or merged_attention or bf16_pending or graph_decode or trees or preemption or per_group or rope" 2>&1 \
    | tail -8 | cut -c1-300
echo "== attention pair, 28 layers ($SECONDS s)"
PYTHONPATH=src timeout -k 5 100 python3 bench/decode_kernels.py --kernels attention --prompt-targets 528,264 \
    --out $OUT/attention_pair_layers.json 2>&1 | grep -v "$F" | cut -c1-250
for v in new base new; do
  d=.; [ $v = base ] && d=.v/base
  [ $SECONDS -gt 440 ] && break
  echo "== rollout $v ($SECONDS s)"
  timeout -k 5 90 python3 $d/bench/bench_rollout.py --device cuda --cases 0.6b:8x8,0.6b:64x16 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_${v}_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
done
if [ $SECONDS -lt 470 ]; then
  echo "== profile 64 rows ($SECONDS s)"
  PYTHONPATH=src timeout -k 5 $((560 - SECONDS)) python3 bench/profile_rollout.py --cases 0.6b:8x8 --new-tokens 512 \
      --out $OUT/profile_rollout_64.json 2>&1 | grep -v "$F" | grep "==\|ms/step\| ms \|Error" | head -30 | cut -c1-160
fi
