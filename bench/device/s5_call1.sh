#!/bin/bash
# Device call 1 (session 5, issue 25 item 3): the decode step's new kernels (one-pass sampling race, split-range
# merge): CUDA tests, then the decode profile at 64 rows before (.base = cb4004b, src + bench) and after, same call.
export PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
PYTHONPATH=src timeout 260 python3 -m pytest -v -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "race or merge or graph_stream_matches or trees_match or kept_buffers or decode_matches" 2>&1 \
    | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert" | cut -c1-240 | tee $OUT/cuda_s5_call1.log | tail -30
for v in base new; do
  s=bench/profile_rollout.py; [ $v = base ] && s=.base/bench/profile_rollout.py
  timeout 150 python3 $s --cases 0.6b:8x8 --new-tokens 256 --out $OUT/profile_rollout_$v.json 2>&1 | grep -v "$F" | tail -22
done
