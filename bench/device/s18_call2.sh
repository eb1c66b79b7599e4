#!/bin/bash
# Session 18 call 2 (~9 min, H200). Carry [".whl", ".v"] (.v/base = git archive 8703ba3 src bench).
# Found on the CPU this session: rows that do not decode (finished, ending, slots freed between an agent's turns) kept
# their own slots visible, and the attention kernels read each row's K/V up to its last visible key: a served run's
# non-live rows held a third of the attended keys (CPU, 8 agents x 3 turns). Now `DeviceBatch.set_live` hides them.
# (1) CUDA tests: the whole rollout CUDA file (streams, graphs, preemption, trees, kept buffers) + paging + windows
#     (call 1's selection was cut by its 110 s timeout, no failure in the 44 that ran).
# (2) profile_serve_phases (in process, 600 steady decode steps) base vs new; the A/B instrument is the split kernel's
#     device ms a decode step (call 1: 2.78 ms, 16,800 calls), and the live rows' K/V a step (new line, host state).
#     Predicted: freed slots read the trash block (L2), ending rows their blocks (DRAM): -10..-20% of the kernel
#     (2.78 -> ~2.3-2.5 ms a step), the period with it.
source bench/device/lib.sh
PYTHONPATH=src:tests timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/cuda/test_rollout_cuda.py tests/rollout/test_rollout_paging.py tests/rollout/test_rollout_window_attention.py \
    > $OUT/cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_tests.txt | cut -c1-300 | tail -8
echo "tests done at $SECONDS s"
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
prof() { grep -v "$F" $1 | grep -v "top_host\|top_kern" | grep "^window\|^live rows\|^device in\|_kernel  \|_split_kernel\|_merge_kernel\|in-process  " | cut -c1-160 | head -14; }
for v in new base; do
  src=src; [ $v = base ] && src=.v/base/src
  PYTHONPATH=/tmp/site:$src timeout -k 5 150 python3 bench/profile_serve_phases.py --skip 800 --window 600 \
      --profile-json $OUT/phases_$v.json $ARGS --modes in-process > $OUT/phases_$v.txt 2>&1
  echo "== $v ($SECONDS s)"; prof $OUT/phases_$v.txt
done
