#!/bin/bash
# Device call: the varlen-flash tree attention (issue 11): CUDA test, then auto (flex) vs auto@flash.
set -x
nvidia-smi --query-gpu=name,memory.total --format=csv
export PYTHONPATH=src
timeout 120 python3 -m pytest -q -x tests/test_tree_flash.py 2>&1 | tail -15
timeout 420 python3 bench/profile_engine.py --workloads tree,grpo,agentic,long --configs auto,auto@flash,dfs \
  --profile "agentic:auto@flash,long:auto@flash" --out $OUT/call1 2>&1 | grep -v "^\s*$" | tail -60
