#!/bin/bash
# Session 18 call 4 (~8 min, H200). Carry [".whl"].
# The CUDA tests main has not finished on a GPU since session 17's empty key ranges (calls 1-2 were cut by their
# timeouts: 59 of 87 ran, no failure): the paging and window tests first, then the other CUDA files.
source bench/device/lib.sh
PYTHONPATH=src:tests timeout -k 5 300 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/rollout/test_rollout_window_attention.py tests/rollout/test_rollout_paging.py > $OUT/cuda_paging_window.txt 2>&1
echo "== paging + window ($SECONDS s)"; grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_paging_window.txt | cut -c1-300 | tail -8
PYTHONPATH=src:tests timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/cuda/test_cuda.py tests/cuda/test_chain_attention_cuda.py tests/cuda/test_overlap_cuda.py > $OUT/cuda_other.txt 2>&1
echo "== other CUDA files ($SECONDS s)"; grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_other.txt | cut -c1-300 | tail -8
