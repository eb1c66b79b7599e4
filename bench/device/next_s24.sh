#!/bin/bash
# Prepared in session 23 for the next one (~9 min, H200 or H100). Carry [".v"]; first, here:
#   rm -rf .v && mkdir -p .v/base && git archive 53c7e1c src bench | tar -x -C .v/base   (main before the head's kernels)
# (1) The head kernels' tests: session 23's gradient bound was corrected after its GPU run (9 cases failed on the
#     bound, not the kernel), and has not run on a GPU since.
# (2) Issue 24: the head's Triton kernels against inductor's in ONE process (`-inductorhead`): session 23 measured
#     them only against main before the session, across processes; the gradient kernel's own -15 ms (grpo) / -7 ms
#     (tree) did not show between calls. Profiles of grpo (it gained 1.5-2.5x the prediction: why?) and long (the
#     shape at 53-57%: where its step goes).
# (3) Issue 25: GRPO-step pairs, base vs this tree (the update and forwards run the head's kernels too).
source bench/device/lib.sh
PYTHONPATH=src:tests timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/engine/test_head_kernel.py \
    tests/cuda/test_cuda.py -k "head_kernel or chunk_ or fused_token_loss_head" 2>&1 \
    | grep -v "$F" | grep "FAILED\|passed\|failed\|Error" | cut -c1-300 | tail -8
echo "== engine ($SECONDS s)"
PYTHONPATH=src timeout -k 5 300 python3 bench/profile_engine.py --device cuda --shape qwen3-1.7b \
    --workloads grpo,agentic,long,tree --configs auto-inductorhead,auto,auto-inductorhead,auto --repeats 3 \
    --profile grpo:auto,long:auto --out $OUT 2>&1 | grep -v "$F" | grep "^|" | cut -c1-160
grpo_steps 480 585 2 base new base new
