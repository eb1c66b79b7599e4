#!/bin/bash
# Device call 2 (session 3): the GRPO-step regression, A/B on one machine: 97fc328 (ab_before/, an untracked copy of
# its src + bench) against main, interleaved, at defaults; main once more with dynamo's recompile/graph-break logs.
# ab_before/ is made with: rm -rf ab_before && mkdir ab_before && git archive 97fc328 src bench | tar -x -C ab_before
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
A="--device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto --repeats 3"
for round in 1 2; do
  PYTHONPATH=ab_before/src timeout 140 python3 ab_before/bench/bench_grpo_step.py $A --json $OUT/before_$round.json 2>&1 | grep -v "$F" | tail -2
  PYTHONPATH=src timeout 140 python3 bench/bench_grpo_step.py $A --overlap after --json $OUT/main_$round.json 2>&1 | grep -v "$F" | tail -3
done
PYTHONPATH=src TORCH_LOGS=recompiles,graph_breaks timeout 140 python3 bench/bench_grpo_step.py $A --overlap after > $OUT/main_logs.txt 2>&1
grep -c "Recompiling" $OUT/main_logs.txt; grep -i "recompil\|graph break" $OUT/main_logs.txt | cut -c1-300 | sort | uniq -c | sort -rn | head -30
