#!/bin/bash
# Session 8, device call 6: (1) the memory model's fields on the H100 (Qwen3-1.7B shape, bf16) and the margin a
# 43,485-token call alone may give its kept attentions; (2) the six shapes at the defaults with that margin
# (MemoryPolicy.kept_attention_layers(alone=True)), 2 timed steps each; (3) the CUDA memory test (both limits) and
# the recomputed-blocks float32 test; (4) the GRPO step (0.6B) with fused AdamW, best of 3.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout -k 5 60 python3 -c "
import dataclasses, torch, treerl
from treerl.models import build_model
m = build_model('qwen3', 'qwen3-1.7b', dtype=torch.bfloat16, device='cuda', seed=0)
e = treerl.TreeEngine(m); mm = e.memory.model
print({k: (round(v) if isinstance(v, float) else v) for k, v in dataclasses.asdict(mm).items()})
print('budget GiB', e.memory.budget / 2**30, 'margin(43485) GiB', mm.recompute_margin(43485) / 2**30,
      'call_bytes(43485, recompute) GiB', mm.call_bytes(43485, 0, True) / 2**30)
" 2>&1 | grep -v "$F" | tail -3
timeout -k 5 250 python3 bench/long_trees.py --sections workloads --workloads long_prefix,episodes,grpo,agentic,long,tree \
    --configs auto --repeats 2 --max-seconds 235 --out $OUT/long_trees_s8_margin.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s8_margin.log | grep "^|" | tail -8
timeout -k 5 170 python3 -m pytest -v -s -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "long_trees or compiled_and_recomputed" 2>&1 | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert\|budget" \
    | cut -c1-400 | tee $OUT/cuda_memory_s8_margin.log | tail -8
timeout -k 5 150 python3 bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto \
    --repeats 3 --json $OUT/grpo_step_s8_fused.json 2>&1 | grep -v "$F" | tail -3
