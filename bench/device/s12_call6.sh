#!/bin/bash
# Session 12 call 6 (nvidia-h200): the short request behind 64 agents with prefills in captured buckets that hold them
# (this commit) against the commit before (.v/base, bench_serve.py of this commit), then the CUDA prefill-graph test.
# carry [".whl", ".v"].
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
for v in cover base; do
  s=src; [ $v = base ] && s=.v/base/src
  PYTHONPATH=/tmp/site:$s timeout -k 5 95 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --mixed --probe --repeats 1 --min-tokens 16 --max-tokens 512 --modes in-process \
      --json $OUT/serve_mixed_h200_s12_$v.json 2>&1 | grep -v "$F" | tail -4
done
PYTHONPATH=src timeout -k 5 45 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -k prefill_graphs -p no:cacheprovider \
    2>&1 | tail -1
