#!/bin/bash
# Session 12 call 2 (nvidia-h200): call 1 again with the branch's kernel fixed (its merge loop reused the mask loop's
# int32 variable `c` as a float: Triton refused to compile it, the branch fell back to the torch step). The wide grid
# of the prompt part is dropped (it ran past its 80 s in call 1). Same set-up as s12_call1.sh (.v/main, carry .v).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
BW=$(python3 - <<'PY'
import torch
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record()
for _ in range(20): y.copy_(x)
e.record(); torch.cuda.synchronize(); print(f"{2 * x.numel() * 20 / (s.elapsed_time(e) / 1e3):.3e}")
PY
)
echo "copy bandwidth (read + write) $BW B/s"
for v in main branch; do
  if [ $v = main ]; then root=.v/main; else root=.; fi
  echo "== $v"
  PYTHONPATH=$root/src timeout -k 5 120 python3 $root/bench/bench_rollout.py --device cuda --extras "" --bandwidth $BW \
      --cases 0.6b:8x8,0.6b:64x16 --out $OUT/rollout_merge_ab_${v}_$SECONDS.json 2>&1 | grep -v "$F" | grep "0.6b " | tail -2
done
PYTHONPATH=src timeout -k 5 90 python3 bench/profile_rollout.py --cases 0.6b:8x8,0.6b:64x16 --new-tokens 512 \
    --out $OUT/profile_rollout_merge.json 2>&1 | grep -v "$F" | grep "==\|_kernel\|nvjet" | head -16
PYTHONPATH=src timeout -k 5 140 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE \
    --tb=short 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|assert" | cut -c1-300 | tail -8
