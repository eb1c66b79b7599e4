#!/bin/bash
# Session 14 call 4 (nvidia-h200): issue 23 with finished rows' contexts kept in the prefix cache
# (rollout/kept_contexts.py: an agent's next turn prefills its new tokens and its last completion token, not the whole
# completion) and partial-prefix reuse. (1) the CUDA test of the kept contexts through graphs and the split kernel
# (greedy = eager, float64 logprobs); (2) bench_serve 6 turns, prefix cache 131,072 (the new default), in process and
# served; (3) the same in process at 1afbfb1 (.v/base: no kept contexts; call 3 measured 9,042 tok/s there with the
# same cache). carry [".whl", ".v"].
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=src timeout -k 5 75 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE \
    --tb=short -k "kept_buffers_prefix_cache and not compiled" > $OUT/cuda_kept_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_kept_tests.txt | cut -c1-300 | tail -6
for v in new base; do
  s=src; m=in-process,served; [ $v = base ] && s=.v/base/src && m=in-process
  PYTHONPATH=/tmp/site:$s timeout -k 5 170 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --modes $m --prefix-cache-tokens 131072 \
      --json $OUT/serve_$v.json > $OUT/serve_$v.txt 2>&1
  echo "== $v"; grep -v "$F" $OUT/serve_$v.txt | grep "in-process\|served\|ratio\|alone" | cut -c1-250
done
