#!/bin/bash
# Session 24, call 4 (~5 min): the CUDA tests of the decode step's changes (calls 2-3): the rollout file whole, the new
# bf16 pending-logits test (graphs, the kernel step), the race and rope kernels compiled, the paging/window suites.
source bench/device/lib.sh
PYTHONPATH=src:tests timeout -k 5 250 python3 -m pytest -q -p no:cacheprovider -W ignore tests/cuda/test_rollout_cuda.py \
    tests/rollout/test_race_kernel.py tests/rollout/test_rope_kernel.py 2>&1 \
    | grep -v "$F" | grep "FAILED\|passed\|failed\|Error" | cut -c1-300 | tail -12
echo "== paging/window ($SECONDS s)"
PYTHONPATH=src:tests timeout -k 5 $((330 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -W ignore \
    tests/rollout/test_rollout_window_attention.py tests/rollout/test_rollout_paging.py tests/rollout/test_rollout.py 2>&1 \
    | grep -v "$F" | grep "FAILED\|passed\|failed\|Error" | cut -c1-300 | tail -12
