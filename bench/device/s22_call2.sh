#!/bin/bash
# Session 22 call 2 (nvidia-h200, ~8.5 min). Carry [".v"]; first, here:
#   rm -rf .v && mkdir -p .v/base && git archive c499ffb src bench | tar -x -C .v/base   (main before the fused head)
# (1) Issue 24: call 1's H100-budget rows (2 calls a step) had the fused head 1-2% slower where every one-call row was
#     2-3% faster, one pair each: three alternating pairs of grpo and agentic at that budget, to tell noise from cause.
# (2) Issue 25: the GRPO step (0.6B, 8 x 8, prompt 1,024, 512 new, KL + 2 minibatches), main before the fused head
#     against this tree, alternating. Predicted: the update's head products 4 -> 3 per token (0.6B: the head is 155M
#     of ~596M parameters, ~1.24 of ~3.9 GFLOP a token): update 0.60 s -> ~0.55 s, step 2.11 -> ~2.06 s.
source bench/device/lib.sh
B=$(python3 -c "import torch; print(f'{19.79 * 2**30 / torch.cuda.get_device_properties(0).total_memory:.3f}')")
C=auto-b$B-nofused,auto-b$B
PYTHONPATH=src timeout -k 5 240 python3 bench/profile_engine.py --device cuda --shape qwen3-1.7b \
    --workloads grpo,agentic --configs $C,$C,$C --repeats 3 --out $OUT 2>&1 | grep -v "$F" | grep "^|" | cut -c1-160
echo "== grpo steps ($SECONDS s)"
for v in base new base new; do
  s=src; d=.; [ $v = base ] && s=.v/base/src && d=.v/base
  [ $SECONDS -gt 480 ] && break
  PYTHONPATH=$s timeout -k 5 $((585 - SECONDS)) python3 $d/bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b \
      --dtype bfloat16 --modes auto --stop-every 0 --repeats 2 --json $OUT/grpo_step_$v.json > /tmp/g_$v.txt 2>&1
  echo "== $v ($SECONDS s)"; grep -v "$F" /tmp/g_$v.txt | tail -3 | cut -c1-200
done
