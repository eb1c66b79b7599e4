#!/bin/bash
# For a session with device time (written in session 12; one call, ~4 minutes; any H100/H200 kind).
# Issue 23: on the H200 the in-process serving engine's thread was on a CPU 98% of the run (6.18 of 6.30 s, call 6 of
# session 12): 1,231 decode steps of ~42 rows at ~5 ms a step against ~2.5 ms of GPU work (bench_rollout's 64 rows:
# 2.55 ms a step): Python's work or CUDA's spinning in syncs (counted as CPU time) - a profile tells. This profiles that thread
# (cProfile, after the warm-up run; bench/profile_engine_thread.py) and runs the serving A/B once more with twice the
# probes' time (6 turns), so p99 rests on more than the two slowest of 76 probes.
# The GPU machine has no FastAPI: carry [".whl"] (pip download fastapi uvicorn --only-binary=:all: --python-version
# 3.12 --platform manylinux2014_x86_64 --implementation cp -d .whl).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/site:src timeout -k 5 150 python3 bench/profile_engine_thread.py --device cuda --shape qwen3-0.6b \
    --dtype bfloat16 --mixed --probe --modes in-process --repeats 1 > $OUT/engine_thread_profile.txt 2>&1
grep -v "$F" $OUT/engine_thread_profile.txt | grep -A28 "Ordered by: internal time" | cut -c1-150
PYTHONPATH=/tmp/site:src timeout -k 5 150 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
    --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --modes in-process \
    --json $OUT/serve_mixed_turns6.json 2>&1 | grep -v "$F" | tail -4
