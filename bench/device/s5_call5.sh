#!/bin/bash
# Device call 5 (session 5, issue 25): the rollout benchmark (0.6B at 64 and 1,024 rows, 1.7B at 64 rows; against
# its bandwidth floor) after (src) and before (.base = cb4004b) this session's decode kernels, same call; then the
# CUDA overlap tests (their sequential reference now turns the proximal reuse off).
export PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
for v in new base; do
  s=bench/bench_rollout.py; p=src; [ $v = base ] && s=.base/bench/bench_rollout.py && p=.base/src
  PYTHONPATH=$p timeout 200 python3 $s --device cuda --extras "" --out $OUT/rollout_$v.json 2>&1 | grep -v "$F" | tail -6
done
PYTHONPATH=src timeout 120 python3 -m pytest -q -m cuda tests/cuda/test_overlap_cuda.py -p no:cacheprovider -rfE --tb=short 2>&1 \
    | grep -v "$F" | tail -6
