#!/bin/bash
# Device call 4 (session 3): (a) issue 23: the engine thread's host time under cProfile during the in-process serve
# run (the profiled run of call 3 had the device busy 5.9 s of 24.8 s); (b) issue 24 item 3: the general path
# (a loss not declared separable) against the separable one on the four medium workloads.
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 200 python3 bench/profile_engine_thread.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe \
    --modes in-process --repeats 1 2>&1 | grep -v "$F" | tee $OUT/engine_thread.log | head -110
timeout 330 python3 bench/long_trees.py --sections workloads --workloads grpo,agentic,long,tree --configs auto,auto-general \
    --repeats 2 --out $OUT/general_path_h100.json 2>&1 | grep -v "$F" | tee $OUT/general.log | tail -16
