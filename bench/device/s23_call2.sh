#!/bin/bash
# Session 23, call 2 (carry [".v"], .v/base = 53c7e1c's src and bench: main before the head's kernels):
# (1) the loss head's chunk kernels, variants (bench/loss_head_kernels.py); (2) the new kernel's tests on the GPU;
# (3) profile_engine at defaults, base vs this tree, alternating (4 medium shapes), tree's step profiled last.
source bench/device/lib.sh
PYTHONPATH=src timeout -k 5 150 python3 bench/loss_head_kernels.py --out $OUT 2>&1 | grep -v "$F" | tail -16
echo "== tests ($SECONDS s)"
PYTHONPATH=src:tests timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -W ignore tests/engine/test_head_kernel.py \
    tests/cuda/test_cuda.py -k "head_kernel or chunk_forward or fused_token_loss_head or no_host_sync" 2>&1 | tail -4
for v in base new base new; do
  s=src; d=.; p=""; [ $v = base ] && s=.v/base/src && d=.v/base
  [ $SECONDS -gt 480 ] && break
  echo "== $v ($SECONDS s)"
  mkdir -p $OUT/$v$SECONDS
  PYTHONPATH=$s timeout -k 5 $((590 - SECONDS)) python3 $d/bench/profile_engine.py --device cuda --shape qwen3-1.7b \
      --workloads grpo,agentic,long,tree --configs auto --profile "" --repeats 3 --out $OUT/$v$SECONDS 2>&1 \
      | grep -v "$F" | grep "^| [a-z]" | cut -c1-120
done
echo "== end ($SECONDS s)"
