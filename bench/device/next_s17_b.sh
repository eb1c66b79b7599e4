#!/bin/bash
# For the next session's second call (written in session 16; ~6 minutes, any H100/H200). Carry [".whl", ".v"], with
# .v/s15 = the GRPO step's code before session 16 (here: rm -rf .v && mkdir -p .v/s15 && git archive 60e53a7 src bench
# | tar -x -C .v/s15). At most 8 files under $OUT.
# (1) Issue 23: the own part's merged kernel on the served shape with key tiles of 128 (bench/serve_attention.py's
#     new variants; session 15 call 3: 64-key tiles at 101-104 us a layer, ~73% of the bandwidth, for 44 rows).
#     Predicted: a gain only if per-tile work, not bandwidth, bounds the kernel; if 128-key tiles reach <= 90 us, they
#     become the merged default (then end to end in a later call).
# (2) Issue 25: the GRPO step with the window prefills (the prompts' prefill 712 -> 485 us a layer in the kernel) and
#     the own part merged again, against 60e53a7 in the same call. Predicted: the step within noise (prefill is
#     ~1% of it), rollout inside the step >= 0.95 of bench_rollout.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PYTHONPATH=src timeout -k 5 150 python3 bench/serve_attention.py --out $OUT/serve_attention.json \
    > $OUT/serve_attention.txt 2>&1
grep -v "$F" $OUT/serve_attention.txt | grep "serve: 44 live of 44\|serve: 20\|resources" | cut -c1-160
for v in new s15; do
  s=src; b=bench; [ $v = s15 ] && s=.v/s15/src && b=.v/s15/bench
  PYTHONPATH=$s timeout -k 5 150 python3 $b/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --modes auto --repeats 3 --json $OUT/grpo_step_$v.json > $OUT/grpo_step_$v.txt 2>&1
  echo "== $v"; grep -v "$F" $OUT/grpo_step_$v.txt | tail -3 | cut -c1-200
done
