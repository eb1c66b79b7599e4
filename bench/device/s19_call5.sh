#!/bin/bash
# Session 19 call 5 (~7 min, H200). The CUDA tests of every file this session's change touches, default paths
# included (the split kernel's widening is a no-op for bf16 pools, the copy and RoPE kernels' conversions are
# compile-time branches, the stores' byte views apply to float8 only): the rollout CUDA file, float8, paging,
# K/V copies, prefill windows, the Triton kernels' compile checks.
source bench/device/lib.sh
PYTHONPATH=src:tests timeout -k 5 400 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/cuda/test_kv_fp8_cuda.py tests/cuda/test_rollout_cuda.py tests/rollout/test_rollout_paging.py \
    tests/rollout/test_rollout_kv_copy.py tests/rollout/test_rollout_window_attention.py tests/rollout/test_triton_compile.py \
    > $OUT/cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert\|Error\|disagree" $OUT/cuda_tests.txt | cut -c1-300 | tail -12
echo "done at $SECONDS s"
