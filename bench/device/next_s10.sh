#!/bin/bash
# For the next session with device time (written in session 9, whose ~11 minutes went to measuring session 8's
# margin: bench/device/s9_call1.sh). Call 1 of 2 (~8 minutes), issue 24:
#   scripts/get_dta.sh here first (fetch github:Whisper-6/DynamicTreeAttn), then run with carry [".dta"].
# (1) the root split's bf16 CUDA test against float64 (treerl.engine.attention.ROOT_SPLIT, built in session 9 on the
#     CPU, never run on a GPU) and the group tests beside it (their float64 check moved into a shared helper);
# (2) the root split's A/B on long_prefix (one tree in one call: the 32k root chain through cuDNN's causal kernel and
#     the 8 responses as a group after it, instead of flex's tree mask over the whole call) and on long (two trees in
#     one call: the route must not run, same time). Predicted (bench/RESULTS.md, sessions 8-9): long_prefix
#     3.05 -> 2.55-2.75 s, peak <= the budget, fewer kept layers (each holds ~2.26x);
# (3) long_prefix and episodes against the DTA authors' engine in one process at today's defaults (session 8's
#     same-call ratio 2.08x on long_prefix was before the margin), 2 steps each.
# If (2) wins and the test passes: ROOT_SPLIT = "cuda" by default, with the CUDA memory test (next_s10_b.sh) re-run.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 120 python3 -m pytest -q -m cuda tests/cuda/test_chain_attention_cuda.py -p no:cacheprovider -rfE \
    --tb=short -k "root_split or group_fused" 2>&1 | grep "passed\|failed\|FAILED\|ERROR\|Error\|assert" \
    | cut -c1-300 | tee $OUT/cuda_root_s10.log | tail -5
timeout -k 5 170 python3 bench/long_trees.py --sections workloads --workloads long_prefix,long --configs auto,auto-root \
    --repeats 2 --max-seconds 160 --out $OUT/long_trees_s10_root.json 2>&1 | grep -v "$F" \
    | tee $OUT/long_trees_s10_root.log | grep "^|" | tail -5
MAX_S=170 timeout -k 5 190 bash bench/device/dta_compare.sh --shapes long_prefix,episodes --engines auto,dta \
    --no-grad-check --repeats 2 2>&1 | tail -8
