#!/bin/bash
# Session 16 call 3 (~9 minutes). Issue 23: small prefills' attention through the split kernel (window_attention,
# new) against main (60e53a7, running its own bench from .v/base), both in process on one machine; then the own part's
# policy A/B (main's ranges past LONG_OWN_KEYS vs one merged range per row: call 2's profile had the split kernel at
# 2.93 ms a step + 0.08 ms of merges against session 15's merged 2.73); then the new code served.
# Predicted: small prefills' device time 0.84 -> ~0.45 ms a step (the memory-efficient kernel's 2.2 ms an admission
# and the repeated K/V copies -> ~0.3 ms), in process +5-8% tokens/s, probe behind p50 81 -> ~76 ms.
# Before the call, here: rm -rf .v && mkdir -p .v/base && git archive 60e53a7 src bench | tar -x -C .v/base; carry
# [".whl", ".v"].
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=src:tests timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/rollout/test_rollout_window_attention.py tests/cuda/test_rollout_cuda.py \
    -k "window or kept_buffers or prefill_graphs or graph_stream_matches" > $OUT/cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_tests.txt | cut -c1-300 | tail -6
PYTHONPATH=src timeout -k 5 60 python3 bench/prefill_attention.py --out $OUT/prefill_attention.json \
    > $OUT/prefill_attention.txt 2>&1
grep -v "$F" $OUT/prefill_attention.txt | grep " us \|Error" | cut -c1-200
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
show() { grep -v "$F" $1 | grep "in-process\|served\|ratio\|Error\|error\|treerl from" | grep -v "engine thread" | cut -c1-250; }
PYTHONPATH=/tmp/site:.v/base/src timeout -k 5 130 python3 .v/base/bench/bench_serve.py $ARGS --modes in-process \
    --json $OUT/serve_base.json > $OUT/serve_base.txt 2>&1
echo "== main (60e53a7)"; show $OUT/serve_base.txt
PYTHONPATH=/tmp/site:src timeout -k 5 130 python3 bench/bench_serve.py $ARGS --modes in-process \
    --json $OUT/serve_new.json > $OUT/serve_new.txt 2>&1
echo "== new (window prefill)"; show $OUT/serve_new.txt
PYTHONPATH=/tmp/site:src timeout -k 5 130 python3 -c "
import runpy, sys
import treerl.rollout.shared as shared
shared.LONG_OWN_KEYS = 1 << 30  # one merged key range per row (session 15's policy before the ranges)
sys.argv = ['bench/bench_serve.py'] + sys.argv[1:]
runpy.run_path('bench/bench_serve.py', run_name='__main__')" $ARGS --modes in-process \
    --json $OUT/serve_new_merged.json > $OUT/serve_new_merged.txt 2>&1
echo "== new, own part merged"; show $OUT/serve_new_merged.txt
echo "elapsed $SECONDS s"
if [ $SECONDS -lt 400 ]; then
PYTHONPATH=/tmp/site:src timeout -k 5 $((590 - SECONDS)) python3 bench/bench_serve.py $ARGS --modes served \
    --server-log $OUT/serve_log.txt --json $OUT/serve_new_served.json > $OUT/serve_new_served.txt 2>&1
echo "== new, served"; show $OUT/serve_new_served.txt
fi
