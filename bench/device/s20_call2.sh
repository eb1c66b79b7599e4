#!/bin/bash
# Session 20 call 2 (~9.5 min, H200). Carry [".whl", ".v"] (.v/base: git archive 1805b25 src bench, the code before
# the prefix cache's integer ids).
# Call 1 (cProfile of 600 steady decode steps in process): set.add / set.discard of the prefix cache's index took
# 0.38 s of the engine thread's 3.83 s (each hashed a whole token tuple once per 16-token block), prefix_cache.insert
# 0.53 s in all; the device idled ~0.5 ms a step (5.04 wall vs 4.47 busy, session 18), in admissions and reads.
# Now the index holds integer ids (lookup+insert at 2k tokens 2.64 -> 0.54 ms on the CPU).
# Predicted: the engine thread -0.4..-0.6 ms of host work a step; in process tokens/s +5..+10% (8,241-8,673 ->
# ~9,000-9,400), the device's idle a step down by about as much; the probe's p50 ratio -0.1..-0.2.
source bench/device/lib.sh
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 bench/bench_serve.py $ARGS --modes in-process --json $OUT/new_inproc.json > $OUT/new_inproc.txt 2>&1
echo "== new in-process ($SECONDS s)"; show $OUT/new_inproc.txt
PYTHONPATH=/tmp/site:.v/base/src timeout -k 5 110 python3 .v/base/bench/bench_serve.py $ARGS --modes in-process --json $OUT/base_inproc.json > $OUT/base_inproc.txt 2>&1
echo "== base in-process ($SECONDS s)"; show $OUT/base_inproc.txt
PYTHONPATH=/tmp/site:src timeout -k 5 170 python3 bench/profile_serve_phases.py --skip 800 --window 600 \
    --profile-json $OUT/phases.json $ARGS --modes in-process > $OUT/phases.txt 2>&1
echo "== phases new ($SECONDS s)"; grep -v "$F" $OUT/phases.txt | grep "^window\|^device idle\|    idle\|^live rows\|in-process  " | cut -c1-160 | head -16
PYTHONPATH=/tmp/site:src timeout -k 5 $((585 - SECONDS)) python3 bench/bench_serve.py $ARGS --modes served --client-procs 8 --json $OUT/new_served.json > $OUT/new_served.txt 2>&1
echo "== new served ($SECONDS s)"; show $OUT/new_served.txt
