#!/bin/bash
# Session 18 call 3 (~9 min, H200). Carry [".whl", ".v"] (.v/base = git archive 8703ba3 src bench).
# Issue 25: the GRPO step (bench_grpo_step.py, Qwen3-0.6B bf16, 8 x 8, prompt 1,024, up to 512 new tokens, auto),
# base 8703ba3 against cf66572 (rows that do not decode show no own slot; groups without a live row no prompt slot).
# Workloads: stop-every=0 (the issue's: every row runs to 512: nothing changes) and stop-every=128 (rows end after
# ~128 tokens, geometric: finished rows in running groups, a tail: where the change removes reads).
# Predicted: stop-every=0 equal within the spread (2.12-2.56 s over sessions 12-17); stop-every=128 rollout -5..-10%
# (finished rows' own K/V, up to 512 keys each, no longer read every step of their group's tail).
source bench/device/lib.sh
for v in new base; do
  s=src; b=bench; [ $v = base ] && s=.v/base/src && b=.v/base/bench
  PYTHONPATH=$s timeout -k 5 250 python3 $b/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --modes auto --stop-every 0,128 --repeats 2 --json $OUT/grpo_step_$v.json > $OUT/grpo_step_$v.txt 2>&1
  echo "== $v ($SECONDS s)"; grep -v "$F" $OUT/grpo_step_$v.txt | tail -6 | cut -c1-200
done
