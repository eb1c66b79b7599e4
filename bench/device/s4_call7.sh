#!/bin/bash
# Device call 7 (session 4): the engine's CUDA tests that call 6 did not reach (its first 10 passed), then a cProfile
# of the serving engine's thread with prefill graphs (where its host time goes now; session 3's profile before them:
# results/engine_thread_profile_h100.txt).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 300 python3 -m pytest -v -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "not test_flex_float32_matches_per_sequence and not test_no_host_sync_per_segment" 2>&1 \
    | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error" | cut -c1-200 | tee $OUT/cuda_engine_s4b.log | tail -20
timeout 200 python3 bench/profile_engine_thread.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe \
    --modes in-process --repeats 1 > $OUT/engine_thread_profile_s4.txt 2>&1
grep -v "$F" $OUT/engine_thread_profile_s4.txt | head -60 | cut -c1-180
