#!/bin/bash
# Session 16 call 4 (~8 minutes). Issue 23: the session's changes (small prefills through window_attention, one
# compiled variant for every bucket, the own part merged wherever rows fill the GPU) against main at the session's
# start (60e53a7, its own bench from .v/base), in process on one machine, then served; a second in-process run of
# the new code if time is left (the spread of one setting). Predicted from call 3: in process ~9,600 tok/s (main
# ~9,140), no probe past ~0.2 s but the first (no Triton compile in the timed run), behind p50 ~71 ms.
# Before the call, here: rm -rf .v && mkdir -p .v/base && git archive 60e53a7 src bench | tar -x -C .v/base; carry
# [".whl", ".v"]. At most 8 files under $OUT (call 3 wrote 12: 4 did not come back).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=src:tests timeout -k 5 100 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/rollout/test_rollout_window_attention.py tests/cuda/test_rollout_cuda.py \
    -k "window or kept_buffers or prefill_graphs or merged_attention" > $OUT/cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_tests.txt | cut -c1-300 | tail -6
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
show() { grep -v "$F" $1 | grep "in-process\|served\|ratio\|Error\|error\|treerl from" | grep -v "engine thread" | cut -c1-250; }
PYTHONPATH=/tmp/site:.v/base/src timeout -k 5 130 python3 .v/base/bench/bench_serve.py $ARGS --modes in-process \
    --json $OUT/serve_base.json > $OUT/serve_base.txt 2>&1
echo "== main (60e53a7)"; show $OUT/serve_base.txt
PYTHONPATH=/tmp/site:src timeout -k 5 130 python3 bench/bench_serve.py $ARGS --modes in-process \
    --json $OUT/serve_new.json > $OUT/serve_new.txt 2>&1
echo "== new"; show $OUT/serve_new.txt
PYTHONPATH=/tmp/site:src timeout -k 5 180 python3 bench/bench_serve.py $ARGS --modes served \
    --json $OUT/serve_served.json > $OUT/serve_served.txt 2>&1
echo "== new, served"; show $OUT/serve_served.txt
echo "elapsed $SECONDS s"
if [ $SECONDS -lt 430 ]; then
PYTHONPATH=/tmp/site:src timeout -k 5 $((585 - SECONDS)) python3 bench/bench_serve.py $ARGS --modes in-process \
    > /tmp/serve_new2.txt 2>&1
echo "== new again"; show /tmp/serve_new2.txt
fi
