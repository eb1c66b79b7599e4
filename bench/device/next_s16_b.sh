#!/bin/bash
# For the next session's second call (written in session 15; ~4 minutes): the serving period at steady state with
# main (profile_serve_phases: 600 decode steps after the timed run's first 800), to set beside session 15 call 2's
# (decode 3.78 ms of device time a step, the own part's split kernel 2.73, small prefills 0.87, DeviceBatch.load
# 0.26, LogReader.finish 0.15). Predicted: the split kernel ~2.45 ms (own spans past LONG_OWN_KEYS in ranges),
# DeviceBatch.load ~0.08 and LogReader.finish ~0.05 (kv_copy's kernel); then a first-probe window (--skip 0
# --window 100) for the probe sent with the agents' first prompts (0.45-0.99 s in session 15).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
# (a fresh machine: the serving wheels first; profile_serve_phases imports bench_serve, which imports the server)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072 --modes in-process"
PYTHONPATH=/tmp/site:src timeout -k 5 170 python3 bench/profile_serve_phases.py --skip 800 --window 600 --profile-json \
    $OUT/serve_phases.json $ARGS > $OUT/serve_phases.txt 2>&1
grep -v "$F" $OUT/serve_phases.txt | grep -v "top_host\|top_kern" | grep -A40 "^window" | cut -c1-180 | head -50
PYTHONPATH=/tmp/site:src timeout -k 5 150 python3 bench/profile_serve_phases.py --skip 0 --window 100 --profile-json \
    $OUT/serve_phases_start.json $ARGS > $OUT/serve_phases_start.txt 2>&1
grep -v "$F" $OUT/serve_phases_start.txt | grep -v "top_host\|top_kern" | grep -A30 "^window" | cut -c1-180 | head -35
