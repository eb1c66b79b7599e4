#!/bin/bash
# Session 14 call 2 (nvidia-h200): (1) issue 23: where the serving engine's decode-step period goes with the reads
# that do not wait (call 1: the engine thread on a CPU 11.95 s of 12.09 s, 5.2 ms a step against ~2.4 ms of device
# work): the torch profiler in the engine thread over 1,000 decode steps of the 6-turn timed run, phases labelled,
# CUDA events around each decode step; (2) issue 25: the GRPO step at main against session 12's e3a5b47 (.v/s12:
# its src and bench_grpo_step.py), same call (call 1 measured forwards 0.37 s and update 0.74 s against session 12's
# 0.244 / 0.596 on another H200). carry [".whl", ".v"].
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/site:src timeout -k 5 200 python3 bench/profile_serve_phases.py --window 1000 --profile-json \
    $OUT/serve_phases.json --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 \
    --min-tokens 16 --max-tokens 512 --modes in-process > $OUT/serve_phases.txt 2>&1
grep -v "$F" $OUT/serve_phases.txt | grep "window\|events\|phases\|x  cuda\|x  aten::copy\|x  aten::item\|x  Memcpy\|tok/s\|in-process  \|alone" | cut -c1-180 | head -40
for v in new s12; do
  s=src; b=bench; [ $v = s12 ] && s=.v/s12/src && b=.v/s12/bench
  PYTHONPATH=$s timeout -k 5 150 python3 $b/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --modes auto --repeats 3 --json $OUT/grpo_step_$v.json > $OUT/grpo_step_$v.txt 2>&1
  echo "== $v"; grep -v "$F" $OUT/grpo_step_$v.txt | tail -3 | cut -c1-200
done
