#!/bin/bash
# Session 15 call 4 (nvidia-h200), issue 23: paged key ranges that follow each row's length, long own spans in
# ranges, own spans in power-of-two buckets (commit after c51575b; .v/base = c51575b with its own bench).
# (1) CUDA tests of the decode paths (graphs, kept contexts, trees, preemption, per-group settings, the kernels) and
# the paging kernel tests on the GPU; (2) serve_attention.py with the new kernel (call 3, old kernel: merged 104 us,
# 2 uniform ranges 92 us); (3) bench_serve main in process + served; (4) c51575b in process.
# Predicted: the own-part attention ~85-90 us a layer at 44 rows (row ranges balance better than uniform ones);
# in process +5-8% tokens/s (decode step 3.78 ms device, of which 2.73 ms attention); the served run's step builds
# 4 -> ~0 and its probe p99 from 0.86 s toward the in-process run's ~0.17 s.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=src:tests timeout -k 5 150 python3 -m pytest -q tests/cuda/test_rollout_cuda.py tests/rollout/test_rollout_paging.py \
    -p no:cacheprovider -rfE --tb=short \
    -k "graph_decode or stream_matches or split_kernel or kept_buffers or trees or preemption or per_group or merged_attention or paged or merge_ranges or ranges_follow or block_table" \
    > $OUT/cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_tests.txt | cut -c1-300 | tail -8
PYTHONPATH=src timeout -k 5 80 python3 bench/serve_attention.py --out $OUT/serve_attention.json > $OUT/serve_attention.txt 2>&1
grep -v "$F" $OUT/serve_attention.txt | grep "num_warps': 4, 'num_stages': 2\|528" | cut -c1-160
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=/tmp/site:src timeout -k 5 300 python3 bench/bench_serve.py $ARGS --modes in-process,served \
    --server-log $OUT/serve_log.txt --json $OUT/serve_new.json > $OUT/serve_new.txt 2>&1
echo "== new"; grep -v "$F" $OUT/serve_new.txt | grep "in-process\|served\|ratio\|Error\|error" | cut -c1-250
PYTHONPATH=/tmp/site:.v/base/src timeout -k 5 130 python3 .v/base/bench/bench_serve.py $ARGS --modes in-process \
    --json $OUT/serve_base.json > $OUT/serve_base.txt 2>&1
echo "== base"; grep -v "$F" $OUT/serve_base.txt | grep "in-process" | cut -c1-250
