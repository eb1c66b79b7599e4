#!/bin/bash
# Session 23, call 1 (carry [".v"], .v/base = c499ffb's src and bench): bench/device/next_s23.sh as prepared
# (tree rollouts' step profiled at defaults beside the other medium shapes; GRPO-step pairs while time is left).
source bench/device/lib.sh
PYTHONPATH=src timeout -k 5 300 python3 bench/profile_engine.py --device cuda --shape qwen3-1.7b \
    --workloads grpo,agentic,long,tree --configs auto-nofused,auto --profile tree:auto,tree:auto-nofused --repeats 3 --out $OUT 2>&1 \
    | grep -v "$F" | grep "^|" | cut -c1-160
echo "== grpo steps ($SECONDS s)"
for v in base new base new; do
  s=src; d=.; [ $v = base ] && s=.v/base/src && d=.v/base
  [ $SECONDS -gt 450 ] && break
  PYTHONPATH=$s timeout -k 5 $((585 - SECONDS)) python3 $d/bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b \
      --dtype bfloat16 --modes auto --stop-every 0 --repeats 3 --json $OUT/grpo_step_${v}_$SECONDS.json > /tmp/g.txt 2>&1
  echo "== $v ($SECONDS s)"; grep -v "$F" /tmp/g.txt | grep "after" | cut -c1-200
done
