#!/bin/bash
# Session 30 call 5 (~4 min, the budget's rest). The GRPO step (issue 25's workload) with the prompt part at 264
# programs (the new default) and patched back to 528, one run each. Predicted: rollout -3..-4% (1.06 -> ~1.02 s).
source bench/device/lib.sh
export PYTHONPATH=src
for t in 264 528; do
  [ $SECONDS -gt 150 ] && break
  timeout -k 5 $((235 - SECONDS)) python3 -c "
import runpy, sys
argv = sys.argv[:]
import treerl.rollout.blocks as b
b.PROMPT_PROGRAMS = int(argv[1])
sys.argv = [argv[2]] + argv[3:]
runpy.run_path(argv[2], run_name='__main__')" $t bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --modes auto --stop-every 0 --repeats 1 --json $OUT/grpo_step_$t.json > /tmp/g.txt 2>&1
  echo "== grpo step, prompt part $t ($SECONDS s)"; grep -v "$F" /tmp/g.txt | grep "after\|Error" | cut -c1-200
done
