#!/bin/bash
# Session 11, call 1 (~9.5 minutes), issue 24: session 10's planned call (cuDNN's plan cost when the tree changes every step; the
# root split per tree: its CUDA tests and the workload `long` A/B) + the engine's CUDA test past cuDNN's shape bound +
# the tree mask's attention row on whole tiles (session 10's row ran partial tiles).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
echo "== CUDA tests: root split, shape bound"
timeout -k 5 100 python3 -m pytest -q -m cuda tests/cuda/test_chain_attention_cuda.py -p no:cacheprovider -rfE \
    --tb=short -k "root_split or shape_bound" 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|Error\|assert" | cut -c1-300 | tail -6
echo "== long, grpo: auto vs auto-roots"
timeout -k 5 150 python3 bench/long_trees.py --sections workloads --workloads long,grpo --configs auto,auto-roots \
    --repeats 2 --max-seconds 140 --out $OUT/long_trees_roots.json 2>&1 | grep -v "$F" | grep "^|" | tail -5
echo "== vary long_prefix"
timeout -k 5 150 python3 bench/long_trees.py --sections vary --workloads long_prefix --configs auto-noroot,auto \
    --repeats 6 --max-seconds 135 --out $OUT/long_trees_vary_long_prefix.json 2>&1 | grep -v "$F" | grep "^vary" | tail -16
echo "== vary episodes"
timeout -k 5 110 python3 bench/long_trees.py --sections vary --workloads episodes --configs auto \
    --repeats 4 --max-seconds 95 --out $OUT/long_trees_vary_episodes.json 2>&1 | grep -v "$F" | grep "^vary" | tail -8
echo "== attention rows"
timeout -k 5 70 python3 bench/long_trees.py --sections attention --max-seconds 60 \
    --out $OUT/long_trees_attention.json 2>&1 | grep -v "$F" | grep "^|" | tail -12
