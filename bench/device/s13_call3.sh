#!/bin/bash
# Session 13 call 3 (nvidia-h200): issue 23's serving engine after this session's host-time changes (the stores of all
# layers in one buffer: one gather + one write per admission's load; a burst admitted a chunk per decode step; the
# per-row sampling settings uploaded once) against main before them (.v/base = a6fb853), same bench_serve, 6 turns;
# the new engine thread profiled; the CUDA rollout tests (the stores changed); bench_rollout (the idle chunking runs
# the 1,024-row case's 64 prompts in 8 pieces). carry [".whl", ".v"].
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
for v in new base; do
  s=src; m=in-process,served; [ $v = base ] && s=.v/base/src && m=in-process
  PYTHONPATH=/tmp/site:$s timeout -k 5 170 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --modes $m \
      --json $OUT/serve_mixed_h200_s13_$v.json 2>&1 | grep -v "$F" | tail -9
done
PYTHONPATH=src timeout -k 5 150 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE \
    --tb=short 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|assert" | cut -c1-300 | tail -8
PYTHONPATH=src timeout -k 5 100 python3 bench/bench_rollout.py --device cuda --extras "" --bandwidth 4.277e12 \
    --cases 0.6b:8x8,0.6b:64x16 --out $OUT/rollout_h200_s13.json 2>&1 | grep -v "$F" | grep "0.6b " | tail -2
PYTHONPATH=/tmp/site:src timeout -k 5 100 python3 bench/profile_engine_thread.py --device cuda --shape qwen3-0.6b \
    --dtype bfloat16 --mixed --probe --modes in-process --repeats 1 > $OUT/engine_thread_profile_new.txt 2>&1
grep -v "$F" $OUT/engine_thread_profile_new.txt | grep -A22 "Ordered by: internal time" | cut -c1-150
