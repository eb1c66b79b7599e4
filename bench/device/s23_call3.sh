#!/bin/bash
# Session 23, call 3 (carry [".v"], .v/base = 53c7e1c's src and bench: main before the head's kernels):
# (1) the head's chunk kernels with the Triton gradient (bench/loss_head_kernels.py); (2) the kernels' tests on the
# GPU; (3) profile_engine at defaults, base vs this tree, alternating; (4) GRPO-step pair while time is left.
source bench/device/lib.sh
PYTHONPATH=src timeout -k 5 120 python3 bench/loss_head_kernels.py --out $OUT 2>&1 | grep -v "$F" | tail -20
echo "== tests ($SECONDS s)"
PYTHONPATH=src:tests timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/engine/test_head_kernel.py \
    tests/cuda/test_cuda.py -k "head_kernel or chunk_ or fused_token_loss_head or no_host_sync" 2>&1 \
    | grep -v "$F" | grep "FAILED\|passed\|failed\|Error" | cut -c1-300 | tail -12
for v in base new base new; do
  s=src; d=.; [ $v = base ] && s=.v/base/src && d=.v/base
  [ $SECONDS -gt 400 ] && break
  echo "== $v ($SECONDS s)"
  mkdir -p $OUT/$v$SECONDS
  PYTHONPATH=$s timeout -k 5 $((560 - SECONDS)) python3 $d/bench/profile_engine.py --device cuda --shape qwen3-1.7b \
      --workloads grpo,agentic,long,tree --configs auto --profile "" --repeats 3 --out $OUT/$v$SECONDS 2>&1 \
      | grep -v "$F" | grep "^| [a-z]" | cut -c1-120
done
for v in base new; do
  s=src; d=.; [ $v = base ] && s=.v/base/src && d=.v/base
  [ $SECONDS -gt 470 ] && break
  PYTHONPATH=$s timeout -k 5 $((575 - SECONDS)) python3 $d/bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b \
      --dtype bfloat16 --modes auto --stop-every 0 --repeats 2 --json $OUT/grpo_step_${v}_$SECONDS.json > /tmp/g.txt 2>&1
  echo "== grpo step $v ($SECONDS s)"; grep -v "$F" /tmp/g.txt | grep "after" | cut -c1-200
done
echo "== end ($SECONDS s)"
