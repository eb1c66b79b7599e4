#!/bin/bash
# Session 15 call 2 (nvidia-h200), issue 23. Call 1 found that bench_serve.py puts its own checkout's src first on
# sys.path, so its "base" runs (PYTHONPATH=.v/base/src) ran main: session 14's serving A/Bs compared main with itself.
# Here the base runs its own bench (git archive 1afbfb1 src bench -> .v/base). (1) 1afbfb1 in process (main: call 1,
# 8,603 / 8,758 tok/s); (2) main in process + served with the server's log kept and a watchdog that dumps every
# thread's stack (faulthandler, SIGABRT) of the server and the bench if the run is still going at 250 s (call 1: the
# served mode did not finish in 170 s); (3) the serving period at steady state: profile_serve_phases, 600 decode
# steps after the timed run's first 800. carry [".whl", ".v"].
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/site python3 -c "import fastapi, uvicorn, openai, prometheus_client" || echo "WHEELS MISSING"
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=/tmp/site:.v/base/src timeout -k 5 120 python3 .v/base/bench/bench_serve.py $ARGS --modes in-process \
    --json $OUT/serve_base.json > $OUT/serve_base.txt 2>&1
echo "== base"; grep -v "$F" $OUT/serve_base.txt | grep "in-process" | cut -c1-250
PYTHONFAULTHANDLER=1 PYTHONPATH=/tmp/site:src timeout -k 5 280 python3 bench/bench_serve.py $ARGS --modes in-process,served \
    --server-log $OUT/serve_log.txt --json $OUT/serve_new.json > $OUT/serve_new.txt 2>&1 &
pid=$!
( sleep 250; echo "WATCHDOG at 250 s"; pkill -ABRT -f "treerl.cli serve"; sleep 3; kill -ABRT $pid ) > $OUT/watchdog.txt 2>&1 &
wd=$!
wait $pid; echo "bench exit $?"; kill $wd 2>/dev/null
echo "== new"; grep -v "$F" $OUT/serve_new.txt | grep "in-process\|served\|ratio\|started\|done\|Error\|error" | cut -c1-250
cat $OUT/watchdog.txt; grep -c . $OUT/serve_log.txt
PYTHONPATH=/tmp/site:src timeout -k 5 150 python3 bench/profile_serve_phases.py --skip 800 --window 600 --profile-json \
    $OUT/serve_phases.json $ARGS --modes in-process > $OUT/serve_phases.txt 2>&1
grep -v "$F" $OUT/serve_phases.txt | grep -v "top_host\|top_kern" | grep -A14 "^window" | cut -c1-180 | head -24
