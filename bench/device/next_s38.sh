#!/bin/bash
# Session 38, call 2 (~9 min, H200; carry [".whl"] from bench/device/wheels.sh): the three issues' headline figures at
# this session's code, for the closing note. No change to time; nothing predicted beyond "as sessions 33-35 measured":
# 64 rows 0.48 of the floor (~32.8k tok/s), 1,024 rows ~0.66, GRPO step ~1.8-1.9 s, the short request x2.3-2.4.
source bench/device/lib.sh
export PYTHONPATH=src
for i in 1 2; do echo "== rollout 64 rows ($SECONDS s)"; rollout new; done
echo "== rollout 1,024 rows ($SECONDS s)"
timeout -k 5 120 python3 bench/bench_rollout.py --device cuda --cases 0.6b:64x16 --extras "" --bandwidth 4.277e12 \
    --out $OUT/rollout1024_s38.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
grpo_steps 250 360 2 new
[ $SECONDS -lt 330 ] && serve new in-process 180
[ $SECONDS -lt 440 ] && serve new served $((588 - SECONDS))
echo "== done ($SECONDS s)"
