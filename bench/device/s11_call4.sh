#!/bin/bash
# Session 11, call 4 (~3 minutes, the last device time): long_prefix's tree attention rows only (session 10's open
# row: the tree mask through flex on whole tiles, as the engine pads it, beside the engine's root split and cuDNN).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 190 python3 bench/long_trees.py --sections attention --attention-rows tree --max-seconds 180 \
    --out $OUT/long_trees_attention_tree.json 2>&1 | grep -v "$F" | grep "^|\|route" | tail -12
