#!/bin/bash
# Session 13 call 4 (nvidia-h200), run at c0bb249 (its --prefill-step-tokens was reverted after this call: no gain): issue 23 after this session's changes: the 6-turn serving benchmark
# in process and served (HTTP, openai SDK: its wheel travels in .whl), then admission pacing (prefill_step_tokens 512,
# with the default 8,192-token chunk and with 2,048) in process; the CUDA rollout tests (call 3's output lost them).
# main before the session (a6fb853) ran the same benchmark in call 3 (serve_mixed_h200_s13_base.json). carry [".whl"].
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/site:src timeout -k 5 200 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
    --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --modes in-process,served \
    --json $OUT/serve_mixed_h200_s13_new.json > $OUT/serve_new.txt 2>&1
for c in 8192 2048; do
  PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --modes in-process \
      --prefill-step-tokens 512 --prefill-chunk-tokens $c \
      --json $OUT/serve_mixed_h200_s13_paced512_chunk$c.json > $OUT/serve_paced_chunk$c.txt 2>&1
done
PYTHONPATH=src timeout -k 5 170 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE \
    --tb=short > $OUT/rollout_cuda_tests.txt 2>&1
for f in serve_new serve_paced_chunk8192 serve_paced_chunk2048; do
  echo "== $f"; grep -v "$F" $OUT/$f.txt | grep -v "^  File\|^    \|Traceback" | tail -9 | cut -c1-260
done
grep "passed\|failed\|FAILED\|ERROR" $OUT/rollout_cuda_tests.txt | cut -c1-300 | tail -6
