#!/bin/bash
# Session 8, device call 1 (issue 24): the one pass of a separable loss over chained trees (treerl.engine.one_pass)
# against session 7's end (.v/base8 = git archive f8c8b18; carry [".v"]): long_prefix and episodes, same call; the six
# shapes at the defaults with 3 timed steps each (settles GRPO's 1.867 s of session 7's call 11); then the CUDA test
# of the engine's exactness (float32 against the per-sequence forward, separable and not).
# NOTE: long_trees.py does not put its own tree's src first, so with PYTHONPATH=src the ".v/base8" run below ran the
# NEW code too (its calls and tokens say so): both runs are the one pass (results/long_trees_h100_s8_onepass{,_b}.json).
# Call 2 runs the baseline with PYTHONPATH=.v/base8/src.
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 170 python3 .v/base8/bench/long_trees.py --sections workloads --workloads episodes,long_prefix \
    --configs auto --repeats 2 --max-seconds 150 --out $OUT/long_trees_s8_base.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s8_base.log | grep "^|" | tail -4
timeout -k 5 230 python3 bench/long_trees.py --sections workloads --workloads episodes,long_prefix,grpo,agentic,long,tree \
    --configs auto --repeats 3 --max-seconds 210 --out $OUT/long_trees_s8_onepass.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s8_onepass.log | grep "^|" | tail -8
timeout -k 5 160 python3 -m pytest -q -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "flex_float32" 2>&1 | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert\|budget" \
    | cut -c1-400 | tee $OUT/cuda_engine_s8.log | tail -8
