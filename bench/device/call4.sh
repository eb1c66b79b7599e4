#!/bin/bash
# Device call (issue 12/14, after merging the paged store and the batched admission):
# CUDA rollout tests, the serve benchmark, one GRPO step per phase.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src
timeout 200 python3 -m pytest -q -x tests/test_rollout_paging.py tests/test_rollout_stream.py tests/test_rollout_tree.py -k "cuda or kernel" 2>&1 | tail -3
timeout 220 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --json $OUT/serve.json 2>&1 | grep -v "Warning\|warn\|softmax\|^\s*$" | tail -20
timeout 150 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --repeats 2 --json $OUT/grpo.json 2>&1 | grep -v "Warning\|warn\|softmax\|^\s*$" | tail -12
