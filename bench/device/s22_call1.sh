#!/bin/bash
# Session 22 call 1 (nvidia-h200, ~8 min). Issue 24: the fused loss head (a loss offering token_loss takes the head's
# gradients in its forward: one logits product a chunk instead of two), A/B in one process: `auto-nofused` hides the
# loss's token_loss (the head as before: logits again in the backward). Alternating pairs, the H200's default budget
# and the H100's (19.79 GiB as a fraction of this card). Predicted (grpo, 1.7B, ~49k unique tokens): one product of
# 2 x 49k x 151,936 x 2,048 = 30.5 TFLOP fewer (~45 ms at ~670 TFLOP/s) plus one pass over the logits fewer (~5 ms),
# less the per-chunk loss evaluation (host work, under the device's): -40..-50 ms of ~1.43 s (57% -> ~59% of peak);
# the other shapes in proportion to their unique tokens; memory unchanged within 0.5 GiB.
# Then the CUDA tests: the compiled fused head (fp32, bf16) and the engine's flex paths against float64.
source bench/device/lib.sh
B=$(python3 -c "import torch; print(f'{19.79 * 2**30 / torch.cuda.get_device_properties(0).total_memory:.3f}')")
PYTHONPATH=src timeout -k 5 360 python3 bench/profile_engine.py --device cuda --shape qwen3-1.7b \
    --workloads grpo,agentic,long,tree --configs auto-nofused,auto,auto-b$B-nofused,auto-b$B,auto-nofused,auto \
    --profile grpo:auto --repeats 3 --out $OUT 2>&1 | grep -v "$F" | grep "^|\|peak\|Error\|error\|seqs" | cut -c1-220
echo "== tests ($SECONDS s)"
PYTHONPATH=src timeout -k 5 $((570 - SECONDS)) python3 -m pytest -q -m cuda tests/cuda/test_cuda.py \
    -k "fused or tokens or long_trees_stay_within or no_host_sync" -p no:cacheprovider 2>&1 | tail -4
