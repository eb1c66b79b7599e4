#!/bin/bash
# Device call 2 (session 4, issue 23): small prefills as CUDA graphs. The rollout CUDA tests that cover prefills
# (the new replay test, kept buffers + prefix cache, preemption, trees), then the serve benchmark at the issue's
# workload (64 agents x 3 turns, max_tokens 16-512, mixed temperatures, probe, 4 client processes) at the new
# default, and in process with prefill_graph_tokens=0 (the old path) as the same-machine baseline.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 170 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -k "prefill_graphs or kept_buffers or preemption or trees" \
    -p no:cacheprovider -rfE --tb=short 2>&1 | grep -v "$F" | tail -12
A="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --client-procs 4"
timeout 250 python3 bench/bench_serve.py $A --json $OUT/serve_graphs.json 2>&1 | grep -v "$F" | tee $OUT/serve_graphs.log | tail -14
timeout 150 python3 bench/bench_serve.py $A --modes in-process --prefill-graph-tokens 0 --json $OUT/serve_nographs.json 2>&1 \
    | grep -v "$F" | tee $OUT/serve_nographs.log | tail -8
