#!/bin/bash
# Session 7, device call 4: CUDA rollout tests with the bounded split kernel, then bench_rollout old (.v/main =
# git archive main) against new in the same call (carry [".v"]).
export PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
PYTHONPATH=src timeout 200 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE --tb=short > $OUT/cuda_tests.log 2>&1
grep -v "$F" $OUT/cuda_tests.log | tail -4
for b in old new; do
  s=src; [ $b = old ] && s=.v/main/src
  d=.; [ $b = old ] && d=.v/main
  PYTHONPATH=$s timeout 125 python3 $d/bench/bench_rollout.py --device cuda --extras "" --out $OUT/rollout_$b.json 2>&1 | grep -v "$F" | tail -3
done
