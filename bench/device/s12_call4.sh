#!/bin/bash
# Session 12 call 4 (nvidia-h200): call 3's two rows that did not run. Issue 23's short request behind 64 agents (the
# machine has no fastapi: carried as wheels, carry [".whl"]: pip download fastapi uvicorn --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 --implementation cp -d .whl), and issue 24's other two medium
# shapes (long, tree) at this device's defaults and at the H100's budget.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/site:src timeout -k 5 170 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
    --mixed --probe --repeats 1 --min-tokens 16 --max-tokens 512 --modes in-process \
    --json $OUT/serve_mixed_h200_s12.json 2>&1 | grep -v "$F" | tail -6
PYTHONPATH=src timeout -k 5 220 python3 bench/profile_engine.py --device cuda --shape qwen3-1.7b --workloads long,tree \
    --configs auto-b0.141,auto --profile "" --out $OUT 2>&1 | grep -v "$F" | tail -7
