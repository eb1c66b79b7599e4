#!/bin/bash
# Session 9, device call 1 (issue 24): session 8's last commit (b503363, kept attentions of a lone recomputing call
# may take the memory model's margin) was never measured: session 8 was cut off before its call 6 returned. This is
# call 6 trimmed to the ~10 minutes of device time left: (1) the six shapes at the defaults, 2 timed steps each;
# (2) the CUDA memory test (long trees within the default budget, whole device and a half-device limit) and the
# compiled + recomputed float32 exactness test.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 215 python3 bench/long_trees.py --sections workloads --workloads long_prefix,episodes,grpo,agentic,long,tree \
    --configs auto --repeats 2 --max-seconds 200 --out $OUT/long_trees_s9_margin.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s9_margin.log | grep "^|" | tail -8
timeout -k 5 125 python3 -m pytest -v -s -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "long_trees" 2>&1 | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert\|budget" \
    | cut -c1-600 | tee $OUT/cuda_memory_s9_margin.log | tail -6
timeout -k 5 90 python3 -m pytest -q -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "compiled_and_recomputed and 6-attentions" 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|Error\|assert" \
    | cut -c1-300 | tee $OUT/cuda_kept_s9.log | tail -4
