#!/bin/bash
# Session 25, call 1 (~9 min, H200 or H100). Carry [".v"]; first, here:
#   rm -rf .v && mkdir -p .v/base && git archive d02ee3a src bench | tar -x -C .v/base   (main before the overlap)
# The decode attention's two launches overlapped (programmatic dependent launch): the CUDA tests, the pair alone
# (decode_kernels.py --kernels attention), bench_rollout base/new alternating, then the GRPO step base/new.
# Predicted (session 24's 64-row profile: split attention 1.20 ms of 2.44 a step, ~43 us a layer in two launches of
# ~16 and ~27 us): 64 rows -0.25..-0.40 ms a step (0.38 -> 0.42-0.45 of the floor); 1,024 rows -0.05..-0.2 ms
# (the prompt part is ~70 of ~380 us a layer there).
source bench/device/lib.sh
echo "== cuda tests ($SECONDS s)"
timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider -W ignore tests/cuda/test_rollout_cuda.py \
    -k "overlap or merged_attention or bf16_pending or graph_decode" 2>&1 | tail -12 | cut -c1-300
echo "== attention pair ($SECONDS s)"
PYTHONPATH=src timeout -k 5 90 python3 bench/decode_kernels.py --kernels attention --out $OUT/attention_pair.json \
    2>&1 | grep -v "$F" | cut -c1-250
for v in new base new base; do
  d=.; [ $v = base ] && d=.v/base
  [ $SECONDS -gt 420 ] && break
  echo "== rollout $v ($SECONDS s)"
  timeout -k 5 100 python3 $d/bench/bench_rollout.py --device cuda --cases 0.6b:8x8,0.6b:64x16 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_${v}_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
done
grpo_steps 470 585 1 new base
