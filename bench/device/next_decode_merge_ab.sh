#!/bin/bash
# Issue 25, the branch decode-merge-unmeasured (written in session 11 on the CPU), one call (~8.5 minutes), nvidia-h100-x1.
# Before the call, here: rm -rf .v && mkdir -p .v/main && git archive main src bench | tar -x -C .v/main
# and run with carry [".v"]. main and the branch in the same call, then the rollout CUDA tests on the branch.
# What it changes: the decode step's own part runs one key range per (row, KV head) and merges the prompt part's
# ranges in its epilogue (decode_attention.split_attention_merged): no merge kernel (28 launches a step), no own
# partials written. Predicted from session 11's profile (results/profile_rollout_s11_h100_s11_call3.json):
# - 64 rows: -0.10..-0.14 ms a step (the merge kernel's 0.144 ms; the own part drops from 2 key ranges to 1 per
#   row, 512 programs instead of 1,024, which may give some back): 2.94 -> ~2.82 ms, 45.8% -> ~47.5% of the floor;
# - 1,024 rows (one range per row already): -0.6..-0.78 ms (the merge's 0.777 ms): 20.7 -> ~20.0 ms, 62.7% -> ~65%.
# Merge the branch if both rows gain; if 64 rows loses, keep 2 ranges there (the merge kernel) and merge only above.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
for v in main branch; do
  if [ $v = main ]; then root=.v/main; else root=.; fi
  echo "== $v"
  PYTHONPATH=$root/src timeout -k 5 170 python3 $root/bench/bench_rollout.py --device cuda --extras "" \
      --cases 0.6b:8x8,0.6b:64x16 --out $OUT/rollout_merge_ab_$v.json 2>&1 | grep -v "$F" | tail -6
done
# the prompt part at 1,024 rows (64 groups x 32 queries, 2.57 TB/s alone in session 7, never on the wide grid): more
# key ranges (target 1056-2112) may take it toward 3 TB/s (-0.4 ms a step at 104 -> 89 us a layer)
PYTHONPATH=src timeout -k 5 80 python3 bench/tune_split_attention.py --wide --cases "prefix 64" \
    --out $OUT/tune_split_prefix1024_wide.json 2>&1 | grep -v "$F" | tail -2
PYTHONPATH=src timeout -k 5 90 python3 bench/profile_rollout.py --cases 0.6b:8x8 --new-tokens 512 \
    --out $OUT/profile_rollout_merge.json 2>&1 | grep -v "$F" | head -12
PYTHONPATH=src timeout -k 5 150 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE \
    --tb=short 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|assert" | cut -c1-300 | tail -8
