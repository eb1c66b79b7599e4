#!/bin/bash
# Prepared in session 20 for the next one (~9.5 min, H200). Carry [".whl", ".v"]; first, here:
#   rm -rf .v && mkdir -p .v/c1 && git archive f7ffd2a src bench | tar -x -C .v/c1
# Session 20 measured reads of the decode log two steps behind (READ_LAG = 2) at +12.1% tokens/s in process, one
# run each (call 3; the bench's spread is +-5%). (1) Firm it up: c1 (f7ffd2a: READ_LAG 1) and main, alternating,
# two runs each, in process. Predicted: main +8..+14% in every pair; the probe's p50 ratio within +-0.1 of c1's.
# (2) The rest of tests/cuda/test_rollout_cuda.py with READ_LAG = 2 (call 3 ran out of time before its summary;
# call 4 ran its 8 stream tests: passed). Output files: at most 8 under $OUT.
source bench/device/lib.sh
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
for run in 1 2; do
  PYTHONPATH=/tmp/site:.v/c1/src timeout -k 5 110 python3 .v/c1/bench/bench_serve.py $ARGS --modes in-process --json $OUT/c1_$run.json > /tmp/c1_$run.txt 2>&1
  echo "== c1 run $run ($SECONDS s)"; show /tmp/c1_$run.txt | grep -v slowest
  PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 bench/bench_serve.py $ARGS --modes in-process --json $OUT/main_$run.json > /tmp/main_$run.txt 2>&1
  echo "== main run $run ($SECONDS s)"; show /tmp/main_$run.txt | grep -v slowest
done
PYTHONPATH=src:tests timeout -k 5 $((585 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/cuda/test_rollout_cuda.py > $OUT/cuda_rollout.txt 2>&1
echo "== cuda rollout ($SECONDS s)"; grep "passed\|failed\|FAILED\|Error\|assert\|%\]" $OUT/cuda_rollout.txt | cut -c1-250 | tail -6
