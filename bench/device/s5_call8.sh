#!/bin/bash
# Device call 8 (session 5, issue 25): the rollout CUDA tests not run in calls 1-2 (prefill graphs, preemption,
# the two-level kernels, prompt K/V memory, graphs across streams: the kernel step under each), then the decode
# step's matrix products at 64 and 1,024 rows by how they are called (bench/decode_gemms.py).
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
timeout 260 python3 -m pytest -v -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "prefill_graphs or preemption or two_level or skips_hidden or prompt_kv or survive" 2>&1 \
    | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert" | cut -c1-240 | tee $OUT/cuda_s5_call8.log | tail -20
timeout 200 python3 bench/decode_gemms.py --shape qwen3-0.6b --rows 64,1024 --out $OUT/decode_gemms_h100.json 2>&1 \
    | grep -v "$F" | tail -10
