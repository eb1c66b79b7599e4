#!/bin/bash
# Prepared in session 22 for the next one (~9 min, H200 or H100). Carry [".v"]; first, here:
#   rm -rf .v && mkdir -p .v/base && git archive c499ffb src bench | tar -x -C .v/base   (main before the fused head)
# (1) Issue 24: tree rollouts are 0.3-0.4 points short of 55% on the H200 (0.730 s a step): profile their step at
#     defaults (what else than matmuls and flex attention takes the ~0.28 s left), beside the other three shapes.
#     On an H100 this is also the first measurement of the fused head there (predicted: grpo -40..-60 ms, the H100's
#     head products at the same peak and its logits passes at 0.7x the H200's bandwidth).
# (2) Issue 25: session 22's GRPO-step pairs could not resolve the fused head's predicted ~-19 ms in the update
#     (run-to-run spread 0.57-0.63 s, one 0.80 s outlier): three alternating pairs with 3 repeats each.
source bench/device/lib.sh
PYTHONPATH=src timeout -k 5 240 python3 bench/profile_engine.py --device cuda --shape qwen3-1.7b \
    --workloads grpo,agentic,long,tree --configs auto-nofused,auto --profile tree:auto --repeats 3 --out $OUT 2>&1 \
    | grep -v "$F" | grep "^|" | cut -c1-160
echo "== grpo steps ($SECONDS s)"
for v in base new base new base new; do
  s=src; d=.; [ $v = base ] && s=.v/base/src && d=.v/base
  [ $SECONDS -gt 500 ] && break
  PYTHONPATH=$s timeout -k 5 $((585 - SECONDS)) python3 $d/bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b \
      --dtype bfloat16 --modes auto --stop-every 0 --repeats 3 --json $OUT/grpo_step_${v}_$SECONDS.json > /tmp/g.txt 2>&1
  echo "== $v ($SECONDS s)"; grep -v "$F" /tmp/g.txt | grep "after" | cut -c1-200
done
