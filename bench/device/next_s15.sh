#!/bin/bash
# For the next session's first call (written in session 14, whose device time ran out; ~6 minutes, any H100/H200).
# Before the call, here: rm -rf .v && mkdir -p .v/base && git archive 1afbfb1 src | tar -x -C .v/base
# (main before finished rows' contexts were kept in the prefix cache) and run with carry [".whl", ".v"] (.whl:
# fastapi, uvicorn, openai, prometheus_client wheels; see the summary in RESULTS.md session 13 for how to make them).
# 1. The CUDA test of kept contexts through graphs and the split kernel (session 14 call 4: 2 passed), then the whole
#    CUDA rollout file if time allows.
# 2. Issue 23: bench_serve 6 turns at a prefix cache of 131,072 (the new default): main against 1afbfb1, in process,
#    and served for main. Main holds four unmeasured changes: kept contexts (8f1d776, 86b9035, e7ec0c8), fewest new
#    tokens first at admission (3b8ad22), merge_ranges (76ebb7c, e8da6ed: the merge of a few long rows' ranges in
#    one kernel) and the empty prompt part (80a08bd); if the whole does not gain, a second call bisects them. Predicted (RESULTS.md session
#    14): >= 9,042 tok/s in process, probe p50 ratio < x2.0, p99 < x3.2; served / in process >= 0.9. If the kept
#    contexts do not gain: revert 8f1d776 and 86b9035. Also in "new": admissions take the fewest new tokens after the
#    oldest (3b8ad22): the probe sent with the agents' first prompts (probe_slowest at start 0.00) should fall from
#    0.26-0.47 s to ~0.1-0.17 s. And merge_ranges (76ebb7c): the alone probe's p50 (one row) 37-40 ms -> ~30 ms.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/site python3 -c "import fastapi, uvicorn, openai, prometheus_client" || echo "WHEELS MISSING"
PYTHONPATH=src timeout -k 5 100 python3 -m pytest -q tests/cuda/test_rollout_cuda.py tests/rollout/test_rollout_paging.py \
    -p no:cacheprovider -rfE --tb=short -k "kept_buffers_prefix_cache and not compiled or merge_ranges or block_table" \
    > $OUT/cuda_kept_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_kept_tests.txt | cut -c1-300 | tail -6
for v in new base; do
  s=src; m=in-process,served; [ $v = base ] && s=.v/base/src && m=in-process
  PYTHONPATH=/tmp/site:$s timeout -k 5 170 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --modes $m --prefix-cache-tokens 131072 \
      --json $OUT/serve_$v.json > $OUT/serve_$v.txt 2>&1
  echo "== $v"; grep -v "$F" $OUT/serve_$v.txt | grep "in-process\|served\|ratio\|alone" | cut -c1-250
done
