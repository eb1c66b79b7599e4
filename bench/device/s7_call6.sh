#!/bin/bash
# Session 7, device call 6: the split kernel timed as CUDA graph replays over 4 rotated input copies: old defaults,
# new defaults, new on a wide grid (carry [".v"]).
export PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
cp bench/tune_split_attention.py .v/main/bench/
echo "== old kernel, defaults"; timeout 90 python3 .v/main/bench/tune_split_attention.py --defaults-only --out $OUT/tune_old.json 2>&1 | grep -v "$F"
echo "== new kernel, defaults"; timeout 90 python3 bench/tune_split_attention.py --defaults-only --out $OUT/tune_new_defaults.json 2>&1 | grep -v "$F"
echo "== new kernel, wide grid"; timeout 330 python3 bench/tune_split_attention.py --wide --cases "prefix 8,own 64,serve" --out $OUT/tune_new_wide.json 2>&1 | grep -v "$F"
