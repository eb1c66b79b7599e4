#!/bin/bash
# Session 15 call 5 (nvidia-h200, the budget's last ~260 s): main with own spans past LONG_OWN_KEYS in uniform key
# ranges + merge_ranges (call 3's kernel bench: 92 vs 104 us a layer at 44 served rows) in process. Baselines on
# other machines: c51575b 8,219 tok/s (call 4), main before it 8,603 / 8,758 / 8,200 / 8,137 (calls 1-3).
# Predicted: the decode step's attention 2.73 -> ~2.4 ms, +5-7% tokens/s (within the runs' spread).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=src timeout -k 5 170 python3 bench/bench_serve.py $ARGS --modes in-process --json $OUT/serve_new.json > $OUT/serve_new.txt 2>&1
echo "== new"; grep -v "$F" $OUT/serve_new.txt | grep "in-process" | cut -c1-250
