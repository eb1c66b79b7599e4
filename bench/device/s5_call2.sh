#!/bin/bash
# Device call 2 (session 5, issue 25 item 3): the kernel step (rope kernel, merge kernel, tail + next norm) and the
# one-pass sampling race: CUDA tests, the decode profile at 64 rows, and one GRPO step before (.base = cb4004b) and
# after, same call.
export PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
PYTHONPATH=src timeout 200 python3 -m pytest -v -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "rope or graph_stream_matches or trees_match or kept_buffers or decode_matches or per_group" 2>&1 \
    | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert\|UserWarning: the decode" | cut -c1-240 | tee $OUT/cuda_s5_call2.log | tail -30
PYTHONPATH=src timeout 100 python3 bench/profile_rollout.py --cases 0.6b:8x8 --new-tokens 256 --out $OUT/profile_rollout_kstep.json 2>&1 | grep -v "$F" | tail -16
A="--device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto --repeats 2"
for v in base new; do
  s=bench/bench_grpo_step.py; p=src; [ $v = base ] && s=.base/bench/bench_grpo_step.py && p=.base/src
  PYTHONPATH=$p timeout 140 python3 $s $A --json $OUT/grpo_step_$v.json 2>&1 | grep -v "$F" | tail -4
done
