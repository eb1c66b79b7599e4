#!/bin/bash
# Session 38, call 3 (~7 min, H200; carry [".v"]: .v/base = git archive 71b447b src bench, session 34's end). Call 2's
# GRPO step read 2.15 s (forwards 0.39, update 0.75) where session 34 read 1.86 (0.23, 0.65) on main before session
# 35's per-call cuDNN allowance. Every step printed with the kernels' shapes: this tree at its default, this tree
# without the per-call bound, session 34's tree. Predicted: if the allowance is the cause, the unbounded run and the
# base read ~1.8-1.9 s and the default run's later steps show deferrals; if not, all three read alike (machine).
source bench/device/lib.sh
A="--device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto --stop-every 0 --repeats 4"
for v in new unbounded base; do
  s=src; [ $v = base ] && s=.v/base/src
  P=""; [ $v = unbounded ] && P="CUDNN_NEW_SHAPES_PER_CALL=None"
  echo "== $v ($SECONDS s)"
  [ $SECONDS -lt 420 ] && TREERL_PLANS="$P" PYTHONPATH=$s timeout -k 5 150 python3 bench/device/grpo_diag.py $A \
      --json $OUT/grpo_diag_${v}_s38.json > $OUT/grpo_diag_${v}_s38.log 2>&1
  grep -v "$F" $OUT/grpo_diag_${v}_s38.log | grep "^step\|settings\|after \|Error" | cut -c1-300
done
echo "== done ($SECONDS s)"
