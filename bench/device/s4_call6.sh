#!/bin/bash
# Device call 6 (session 4): the rollout's CUDA tests, whole file, verbose (call 5's run reached its timeout without a
# summary), the new prefill-graph tests first; then the engine's CUDA tests in the time left.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
T=tests/cuda/test_rollout_cuda.py
timeout 400 python3 -m pytest -v -m cuda $T -p no:cacheprovider -rfE --tb=short 2>&1 \
    | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error" | cut -c1-200 | tee $OUT/cuda_rollout_s4.log | tail -30
timeout 150 python3 -m pytest -v -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short 2>&1 \
    | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error" | cut -c1-200 | tee $OUT/cuda_engine_s4.log | tail -30
