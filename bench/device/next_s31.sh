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
at() {  # at PROGRAMS SCRIPT ARGS...: a benchmark with the prompt part's programs patched
  local t=$1 script=$2; shift 2
  timeout -k 5 120 python3 -c "
import atexit, runpy, sys
argv = sys.argv[:]
import treerl.rollout.blocks as b, treerl.rollout.shared as sh
b.PROMPT_PROGRAMS = int(argv[1])
seen, inner = set(), sh.split_attention
def spy(q, *a, **k):
    out = inner(q, *a, **k)
    if k.get('trigger'):
        seen.add((tuple(q.shape), out[0].shape[2]))
    return out
sh.split_attention = spy
atexit.register(lambda: print('prompt part (q shape, ranges):', sorted(seen)))
sys.argv = [argv[2]] + argv[3:]
runpy.run_path(argv[2], run_name='__main__')" $t $script "$@" 2>&1 | grep -v "$F" | grep "^1.7b\|^0.6b\|after\|FAILED\|Error\|prompt part" | cut -c1-200
}
for t in 264 528 264 528; do
  [ $SECONDS -lt 380 ] && { echo "== 1.7b 64 rows, $t ($SECONDS s)"; at $t bench/bench_rollout.py --device cuda --cases 1.7b:8x8 --extras "" --bandwidth 4.277e12; }
done
for t in 264 528; do
  [ $SECONDS -lt 440 ] && { echo "== 1.7b GRPO step, $t ($SECONDS s)"; at $t bench/bench_grpo_step.py --device cuda --shape qwen3-1.7b --dtype bfloat16 --modes auto --stop-every 0 --repeats 1; }
done
echo "== done ($SECONDS s)"
