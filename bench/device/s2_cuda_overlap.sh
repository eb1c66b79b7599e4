#!/bin/bash
# Device call (session 2, issues 25/27): every CUDA test after the layout/one-home refactors and the overlap;
# then the GRPO step with the forwards overlapped (A/B: after / stream / stream without priority / inline),
# rows running to 512 tokens (no stops) and with every 128th token id a stop (groups finish apart).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 300 python3 -m pytest -q -m cuda tests -p no:cacheprovider -rfE 2>&1 | grep -v "$F" | tee $OUT/cuda_tests.log | tail -30
timeout 270 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto \
    --overlap after,stream,stream-nopriority,inline --stop-every 0,128 --repeats 2 --json $OUT/grpo_step_overlap_0.6b.json \
    2>&1 | grep -v "$F" | tee $OUT/grpo_overlap.log | tail -30
