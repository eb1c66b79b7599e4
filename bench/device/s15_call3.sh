#!/bin/bash
# Session 15 call 3 (nvidia-h200), issue 23. Call 2's steady-state profile (600 decode steps after the first 800):
# a decode step 3.78 ms of device time, of which the own-part split kernel 2.73 ms (72%); admissions ~1.4 ms a step.
# (1) bench/serve_attention.py: that kernel on the serving shape, merged one range per row (the default there) with
# its tile settings against split ranges + merge_ranges; (2) main in process + served (call 2's served run was lost
# to a JSON bug in --server-log: fixed), the server's log kept, a watchdog dumping stacks at 320 s.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=src timeout -k 5 150 python3 bench/serve_attention.py --out $OUT/serve_attention.json > $OUT/serve_attention.txt 2>&1
grep -v "$F" $OUT/serve_attention.txt | cut -c1-160 | tail -45
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONFAULTHANDLER=1 PYTHONPATH=/tmp/site:src timeout -k 5 340 python3 bench/bench_serve.py $ARGS --modes in-process,served \
    --server-log $OUT/serve_log.txt --json $OUT/serve_new.json > $OUT/serve_new.txt 2>&1 &
pid=$!
( sleep 320; echo "WATCHDOG at 320 s"; pkill -ABRT -f "treerl.cli serve"; sleep 3; kill -ABRT $pid ) > $OUT/watchdog.txt 2>&1 &
wd=$!
wait $pid; echo "bench exit $?"; kill $wd 2>/dev/null
echo "== new"; grep -v "$F" $OUT/serve_new.txt | grep "in-process\|served\|ratio\|started\|done\|Error\|error" | cut -c1-250
cat $OUT/watchdog.txt
