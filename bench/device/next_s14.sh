#!/bin/bash
# For the next session (written in session 13, not run: its device time ran out; ~8 minutes, any H100/H200 kind).
# Before the call, here: rm -rf .v && mkdir -p .v/base && git archive e6ad47a~1 src | tar -x -C .v/base
# (main before the reads of the decode log stopped waiting) and run with carry [".whl", ".v"] (.whl: fastapi, uvicorn,
# openai and prometheus_client wheels, see s13_call4.sh; the GPU machine has none of them).
# 1. The CUDA rollout tests first: the reads (rollout/log_reads.py) change every rollout's loop, and no CUDA test has
#    run them yet. If they fail: revert e6ad47a..ae0f29a's rollout changes (log_reads.py and its users).
# 2. Issue 23: the serving benchmark (6 turns) with the reads against the commit before them, in process; served too
#    for the new code. Predicted: in process +15-30% tok/s (call 4 of session 13: 7,949), probe p50 ratio ~x2.0
#    (x2.31), served / in process >= 0.9 (0.895).
# 3. Issue 25: bench_rollout (64 and 1,024 rows) and the GRPO step with the reads (session 12: 25,123 / 64,559 tok/s,
#    step 2.151 s on an H200).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=src timeout -k 5 170 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE \
    --tb=short > $OUT/rollout_cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/rollout_cuda_tests.txt | cut -c1-300 | tail -6
for v in new base; do
  s=src; m=in-process,served; [ $v = base ] && s=.v/base/src && m=in-process
  PYTHONPATH=/tmp/site:$s timeout -k 5 170 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --modes $m \
      --json $OUT/serve_mixed_$v.json > $OUT/serve_$v.txt 2>&1
  echo "== $v"; grep -v "$F" $OUT/serve_$v.txt | grep -v "^  File\|^    \|Traceback" | tail -9 | cut -c1-260
done
PYTHONPATH=src timeout -k 5 100 python3 bench/bench_rollout.py --device cuda --extras "" --bandwidth 4.277e12 \
    --cases 0.6b:8x8,0.6b:64x16 --out $OUT/rollout.json 2>&1 | grep -v "$F" | grep "0.6b " | tail -2
PYTHONPATH=src timeout -k 5 160 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
    --modes auto --repeats 3 --json $OUT/grpo_step.json 2>&1 | grep -v "$F" | tail -4
