#!/bin/bash
# For the next session's first call (written in session 16, whose device time ran out; ~9 minutes, any H100/H200).
# Carry [".whl"]. At most 8 files under $OUT (more do not come back).
# Issue 23. Unmeasured in main: window_attention's kernels unspecialised on sizes (one compiled variant per query
# tile, compiled by the probe before serving; session 16 calls 3-4 had one 0.77-1.16 s probe a run from a compile in
# the timed run). Predicted: no probe past ~0.2 s but the first; in process ~10k tok/s, behind p50 ~71 ms.
# Served with 8 client processes (session 16 call 4 ran one: 22 ms of client CPU a request, served / in process
# 0.74-0.78, the served batch 39.7 rows a step against 44.4). Predicted: served >= 0.9 of in process.
# Also unmeasured: own spans past 1,024 slots in grains that double with the span (scheduler.own_bucket: half as
# many decode graphs up to 4,096). Predicted: the served timed run builds 0-1 decode steps (session 16: 2-3).
# Then the steady-state profile of the step after the window prefills (session 16 call 2: decode 4.04 ms, small
# prefills 0.84 ms a step, of which 2.2 ms an admission in the memory-efficient kernel). Predicted: prefills
# ~0.35 ms a step, decode ~3.8 ms (one merged range per row again).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=src:tests timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/rollout/test_rollout_window_attention.py tests/cuda/test_rollout_cuda.py -k "window or prefill_graphs" \
    > $OUT/cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_tests.txt | cut -c1-300 | tail -6
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
show() { grep -v "$F" $1 | grep "in-process\|served\|ratio\|Error\|error\|treerl from" | cut -c1-250; }
PYTHONPATH=/tmp/site:src timeout -k 5 260 python3 bench/bench_serve.py $ARGS --modes in-process,served \
    --client-procs 8 --json $OUT/serve.json > $OUT/serve.txt 2>&1
echo "== in process + served (8 client processes)"; show $OUT/serve.txt
PYTHONPATH=/tmp/site:src timeout -k 5 170 python3 bench/profile_serve_phases.py --skip 800 --window 600 \
    --profile-json $OUT/serve_phases.json $ARGS --modes in-process > $OUT/serve_phases.txt 2>&1
grep -v "$F" $OUT/serve_phases.txt | grep -v "top_host\|top_kern" | grep "^window\|^device in\|_kernel\|fmha" | cut -c1-180 | head -30
