#!/bin/bash
# Session 38, call 6 (~2.5 min, H200): call 5's in-process run at 3 turns stalled its first probe 8.8 s (the timed
# run's start; 0.3-0.9 s in the other runs). Again, with dynamo's recompiles and graph breaks logged and the engine's
# prefill captures timed, to see whether a compile (a new shape in the timed run) is the stall.
source bench/device/lib.sh
export PYTHONPATH=/tmp/site:src  # (carry [".whl"]: fastapi for the serve package)
TORCH_LOGS="recompiles" timeout -k 5 200 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b \
    --dtype bfloat16 --mixed --probe --repeats 1 --turns 3 --min-tokens 16 --max-tokens 512 \
    --prefix-cache-tokens 131072 --modes in-process --client-procs 8 --json $OUT/serve_t3_diag_s38.json > $OUT/serve_t3_diag_s38.txt 2>&1
echo "rc $? ($SECONDS s)"
grep -n "untimed run\|timed run\|Recompiling\|recompil\|slowest\|x1\.\|x2\.\|tok/s" $OUT/serve_t3_diag_s38.txt | cut -c1-300 | head -40
