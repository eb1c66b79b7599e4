#!/bin/bash
# Prepared in session 30 for the next one (~8 min, H200 or H100; carry [".whl"]). Session 30 set the kernel step's
# prompt part to 264 programs (blocks.PROMPT_PROGRAMS: 64 rows +3.2%, 1,024 rows +4.0%) and measured it on GRPO groups
# only. (1) The rest of the CUDA rollout tests at the new default (trees, forks, preemption: their prompt part
# runs through the same setting). (2) The 1.7B shape's rollout at 264 against 528
# (patched; the wrapper prints the ranges each capture ran, so a patch that does not take is seen), and the 1.7B
# GRPO step (issue 25's second shape). Predicted: 1.7B 64 rows +2..4%; its GRPO step's rollout -2..-3%.
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 200 "not overlapped and not merged and not graph_decode and not bf16" tests/cuda/test_rollout_cuda.py
at() {  # at PROGRAMS SCRIPT ARGS...: a benchmark with the prompt part's programs patched (lib.sh's `patched`)
  patched 120 "$@" 2>&1 | grep -v "$F" | grep "^1.7b\|^0.6b\|after\|FAILED\|Error\|prompt part" | cut -c1-200
}
for t in 264 528 264 528; do
  [ $SECONDS -lt 380 ] && { echo "== 1.7b 64 rows, $t ($SECONDS s)"; at $t bench/bench_rollout.py --device cuda --cases 1.7b:8x8 --extras "" --bandwidth 4.277e12; }
done
for t in 264 528; do
  [ $SECONDS -lt 440 ] && { echo "== 1.7b GRPO step, $t ($SECONDS s)"; at $t bench/bench_grpo_step.py --device cuda --shape qwen3-1.7b --dtype bfloat16 --modes auto --stop-every 0 --repeats 1; }
done
echo "== done ($SECONDS s)"
