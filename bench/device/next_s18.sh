#!/bin/bash
# For the next session's first call (written in session 17 after its device time ran out; ~9 min, any H100/H200).
# Carry [".whl"]. At most 8 files under $OUT (more do not come back).
# Issue 23. Unmeasured in main: key ranges past a row's last visible key read nothing (session 17: each read a tile
# before; their LSE is now -inf). Expected to matter where ranges outrun rows: prefill windows over 4,096-slot
# buckets, prompts shorter than the prefix store, the own part in ranges over rows of unequal length.
# (1) CUDA tests of the split kernel's paths (decode, paged, prefill windows, graphs).
# (2) prefill_attention.py: predicted the 1 x 64 x 4,096 bucket (33 new over 2,400) 29.3 -> ~22 us a layer (its 13 of
#     32 empty ranges per query block read 6.8 of 16.6 MB before); the others within 1-2 us.
# (3) serve_attention.py: the own part in ranges at targets 528-4,224 against the merged default (call 3: 103.4 us,
#     ranges 92.2 us at 528 with empty tiles read). Predicted: 2,112 ~85-90 us (balance over unequal rows and no
#     reads past them), the merged default unchanged (one range per row: none empty).
# (4) The served step's device time per decode step (profile_serve_phases, in process), main against the own part
#     forced into ranges of target 2,112 (a bench-only patch). This is the A/B instrument: the kernel's ms per step
#     in the real run, not tokens/s (+-5% between runs of the same code, sessions 16-17). Call 1 of session 17:
#     decode 3.823 ms/step, split kernel 1,685 ms / 600 steps. Predicted: ranges 2.81 -> ~2.45 ms a step of split
#     kernel + ~0.1 ms of merges, if (3) holds.
source bench/device/lib.sh
PYTHONPATH=src:tests timeout -k 5 110 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/rollout/test_rollout_paging.py tests/rollout/test_rollout_window_attention.py tests/cuda/test_rollout_cuda.py \
    -k "split or window or prefill_graphs or block_table or merge" > $OUT/cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_tests.txt | cut -c1-300 | tail -6
PYTHONPATH=src timeout -k 5 40 python3 bench/prefill_attention.py > $OUT/prefill_attention.txt 2>&1
grep -v "$F" $OUT/prefill_attention.txt | grep " us \|Error" | grep "window\|w528\|sdpa" | cut -c1-110
PYTHONPATH=src timeout -k 5 80 python3 bench/serve_attention.py --out $OUT/serve_attention.json > $OUT/serve_attention.txt 2>&1
grep -v "$F" $OUT/serve_attention.txt | grep " us \|resources\|Error" | grep "44 live of 64\|20 live\|64 rows" | cut -c1-125
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
prof() { grep -v "$F" $1 | grep -v "top_host\|top_kern" | grep "^window\|^device in\|_kernel  \|_split_kernel\|_merge_kernel" | cut -c1-150 | head -12; }
PYTHONPATH=/tmp/site:src timeout -k 5 150 python3 bench/profile_serve_phases.py --skip 800 --window 600 \
    --profile-json $OUT/phases_main.json $ARGS --modes in-process > $OUT/phases_main.txt 2>&1
echo "== main (own part merged: one range per row)"; prof $OUT/phases_main.txt
PYTHONPATH=/tmp/site:src timeout -k 5 150 python3 -c "
import functools, runpy, sys
import treerl.rollout.shared as shared
from treerl.rollout import decode_attention as da
shared.MERGED_MIN_PROGRAMS = 1 << 20  # the own part always in key ranges ...
shared.split_attention = functools.partial(da.split_attention, target=2112)  # ... of 2,112 programs at least
sys.argv = ['bench/profile_serve_phases.py'] + sys.argv[1:]
runpy.run_path('bench/profile_serve_phases.py', run_name='__main__')" --skip 800 --window 600 \
    --profile-json $OUT/phases_ranges.json $ARGS --modes in-process > $OUT/phases_ranges.txt 2>&1
echo "== own part in ranges (target 2,112)"; prof $OUT/phases_ranges.txt
echo "elapsed $SECONDS s"
