#!/bin/bash
# Session 34 call 2 (~9.5 min, H200; carry [".dta"], made by scripts/get_dta.sh). Issue 24's six shapes in one run:
# treerl auto and dfs against the DTA authors' engine on the same batches and weights, with the gradient check
# (bench/dta_compare.py: Qwen3-1.7B shape, bf16, paper scale, % of the run's own bf16 matmul peak), treerl at an
# H100's default budget in bytes (--memory-budget 0.141 of the H200's 140.4 GiB = 19.8 GiB, 25% of 79.2 GiB), so its
# plans are the H100's. Then, if time is left, the 1.7B GRPO step (issue 25 asks for it beside the 0.6B one).
source bench/device/lib.sh
export PYTHONPATH=src
ls .dta/tree_training_engine.py || { echo ".dta/ did not travel"; exit 2; }
timeout -k 5 500 python3 bench/dta_compare.py --max-seconds 440 --repeats 2 --memory-budget 0.141 \
    --out $OUT/dta_compare_h200_s34.json > $OUT/dta_compare_h200_s34.log 2>&1
grep -v "$F" $OUT/dta_compare_h200_s34.log | grep "^|\|peak\|Error\|error" | cut -c1-220 | tail -30
echo "== dta done ($SECONDS s)"
if [ $SECONDS -lt 470 ]; then
  timeout -k 5 $((585 - SECONDS)) python3 bench/bench_grpo_step.py --device cuda --shape qwen3-1.7b --dtype bfloat16 \
      --modes auto --stop-every 0 --repeats 1 --json $OUT/grpo_step_1.7b_s34.json > /tmp/g.txt 2>&1
  echo "== grpo 1.7b ($SECONDS s)"; grep -v "$F" /tmp/g.txt | grep "after\|Error" | cut -c1-200
fi
