#!/bin/bash
# Device call 1 (session 3): (a) the gradient bug of session 2 with the mitigations (claim_compiled_code, recompile
# limit 64): the probe's prelude then the compile=True cases as-is; (b) the 0.6B GRPO step at defaults (the 3.00 s
# regression: measured before the recompile limit was raised); (c) the step profile (per-phase, in-step rollout).
export PYTHONPATH=src:tests:tests/cuda PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout 240 python3 bench/gradbug_probe.py --variants as-is 2>&1 | grep -E "^\[|^    |prelude|PASS|FAIL|Error|limit" | tee $OUT/gradbug.log | tail -40
export PYTHONPATH=src
timeout 170 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto --overlap after \
    --repeats 2 --json $OUT/grpo_step_0.6b.json 2>&1 | grep -v "$F" | tee $OUT/grpo.log | tail -8
timeout 170 python3 bench/profile_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --out $OUT/step_profile.json 2>&1 | grep -v "$F" | tee $OUT/step_profile.log | tail -40
