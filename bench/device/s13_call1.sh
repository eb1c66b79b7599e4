#!/bin/bash
# For the next session with device time (written in session 12; one call, ~9 minutes; any H100/H200 kind).
# Before the call, here: rm -rf .v && mkdir -p .v/base && git archive "$(git log --format=%h -1 --grep='^loss head: the weight')~1" src bench | tar -x -C .v/base
# (main before the loss head's change) and run with carry [".v"] (plus ".whl" on an H200 without FastAPI, not needed here).
# 1. Issue 24: the loss head's weight gradient accumulated by the product itself (addmm_, beta = 1) instead of a
#    product then an add per chunk of 883 rows. Predicted from session 12's grpo profile (H200, H100 budget): the bf16
#    adds' ~26 ms of 1.43 s go, less the product's read of the gradient (~0.6 GB a chunk, partly under its compute):
#    grpo -20..-30 ms on an H100 (52.4% -> ~53.3% of peak), agentic alike; no change in memory (one [V x H] transient
#    fewer: lower).
#    The new code's grpo step is profiled (kernel names in full: what else moves memory).
# 2. The CUDA tests of both changes: the loss head through the engine, the prefill graphs (both cases; session 12's
#    call was cut after one).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# the H100's default budget (19.79 GiB) on any card: as a fraction of this one's memory
B=$(python3 -c "import torch; print(f'{19.79 * 2**30 / torch.cuda.get_device_properties(0).total_memory:.3f}')")
for v in new base; do
  s=src; d=.; [ $v = base ] && s=.v/base/src && d=.v/base
  PYTHONPATH=$s timeout -k 5 200 python3 $d/bench/profile_engine.py --device cuda --shape qwen3-1.7b \
      --workloads grpo,agentic --configs auto-b$B --profile "$([ $v = new ] && echo grpo:auto-b$B)" --repeats 3 \
      --out $OUT/loss_head_$v 2>&1 \
      | grep -v "$F" | grep "^|" | tail -3
done
PYTHONPATH=src timeout -k 5 120 python3 -m pytest -q -m cuda tests/cuda/test_rollout_cuda.py -k prefill_graphs \
    -p no:cacheprovider 2>&1 | tail -1
PYTHONPATH=src timeout -k 5 150 python3 -m pytest -q -m cuda tests/cuda/test_cuda.py -k "flex_float32_matches_per_sequence" \
    -p no:cacheprovider 2>&1 | tail -1
