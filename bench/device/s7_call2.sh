#!/bin/bash
# Session 7, device call 2: why the decode branches failed their CUDA tests (compiled+graphs), then bench_rollout
# A/B: main, decode-both-unmeasured, splitk-unmeasured (prep: the .v/ copies of next_decode_ab.sh; carry [".v"]).
export PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
V=.v/decode-both-unmeasured
PYTHONPATH=$V/src timeout 150 python3 -m pytest -q -m cuda --rootdir $V -c $V/pyproject.toml $V/tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE \
  --tb=short -k "kept_buffers_prefix_cache or graph_trees_match or under_preemption" > $OUT/fails.log 2>&1
tail -5 $OUT/fails.log
for b in main decode-both-unmeasured splitk-unmeasured; do
  PYTHONPATH=.v/$b/src timeout 125 python3 .v/$b/bench/bench_rollout.py --device cuda --extras "" --out $OUT/rollout_$b.json \
     2>&1 | grep -v "$F" | tail -4
done
