#!/bin/bash
# Next session, first call (~6 min, H200; no carry). Session 32's lead measured alone before any engine change: the
# head's product and the sampling race in one Triton kernel (bench/device/head_race_probe.py; its checks ran on the
# CPU under the interpreter only). Predicted at 64 rows ~85-105 us against cuBLAS + race_kernel's ~130: if a setting
# is there and its checks hold (tokens = race_reference's bits on its logits), build it into the engine (the decode
# graph ending at the final norm, the kernel where sampling runs, the logits still written before forks, preemption
# and the prefix cache read them). Then the 64-row rollout and the GRPO step at the defaults, for a fresh status.
source bench/device/lib.sh
export PYTHONPATH=src
echo "== head + race ($SECONDS s)"
timeout -k 5 200 python3 bench/device/head_race_probe.py --out $OUT/head_race_next_s33.json 2>&1 | grep -v "$F" \
    | grep "rows\|Error" | cut -c1-220
echo "== rollout 64 rows ($SECONDS s)"
rollout new
grpo_steps 330 460 2 new
echo "== done ($SECONDS s)"
