#!/bin/bash
# For the next session's first call (written in session 15, whose device time ran out; ~9 minutes of its 10, any H100/H200).
# Before the call, here: rm -rf .v && mkdir -p .v/base && git archive 1afbfb1 src bench | tar -x -C .v/base
# (the base runs ITS OWN bench: bench_serve.py now leaves an importable treerl on PYTHONPATH first, but 1afbfb1's
# copy does not) and run with carry [".whl", ".v"].
# Issue 23. Main holds, unmeasured end to end: own spans past LONG_OWN_KEYS (512) in uniform key ranges + merge_ranges
# where rows x heads < TARGET_PROGRAMS (session 15 call 3's kernel bench: 92 vs 104 us a layer at 44 served rows,
# 61 vs 95 us at 20) and the served probe in a client process of its own (calls 3-4: served probes of 0.4-0.87 s
# behind the agents, in-process ones at most 0.18 s: the shared client process's CPU, ~25 ms a long request).
# Also unmeasured: rollout/kv_copy.py, the K/V slot copy kernel (an admitted served row's context into its own
# blocks, a finished row's out of them into the prefix cache; was advanced indexing: call 2's profile 0.26 + 0.15 ms
# a decode step). Predicted: in process +8-12% tokens/s against session 15's main runs (8,137-8,758: the attention
# 2.73 -> ~2.45 ms a step, the copies 0.41 -> ~0.12 ms); served probe p99 from ~0.87 s to near the in-process p99
# (~0.17 s); served / in process >= 0.9. Then next_s16_b.sh: the steady-state profile, phase by phase.
# (1) CUDA tests of the merged/ranged own part; (2) main in process + served; (3) 1afbfb1 in process.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/site python3 -c "import fastapi, uvicorn, openai, prometheus_client" || echo "WHEELS MISSING"
PYTHONPATH=src:tests timeout -k 5 140 python3 -m pytest -q tests/cuda/test_rollout_cuda.py tests/rollout/test_rollout_paging.py \
    -p no:cacheprovider -rfE --tb=short tests/rollout/test_rollout_kv_copy.py -k "merge or kept_buffers or split_kernel or copy" > $OUT/cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_tests.txt | cut -c1-300 | tail -6
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=/tmp/site:src timeout -k 5 300 python3 bench/bench_serve.py $ARGS --modes in-process,served \
    --server-log $OUT/serve_log.txt --json $OUT/serve_new.json > $OUT/serve_new.txt 2>&1
echo "== new"; grep -v "$F" $OUT/serve_new.txt | grep "in-process\|served\|ratio\|Error\|error" | cut -c1-250
PYTHONPATH=/tmp/site:.v/base/src timeout -k 5 130 python3 .v/base/bench/bench_serve.py $ARGS --modes in-process \
    --json $OUT/serve_base.json > $OUT/serve_base.txt 2>&1
echo "== base"; grep -v "$F" $OUT/serve_base.txt | grep "in-process" | cut -c1-250
