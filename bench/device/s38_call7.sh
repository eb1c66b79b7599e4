#!/bin/bash
# Session 38, call 7 (~4 min, H200; carry [".whl"]): call 6's recompiles (the prefill forward's _prefill_pre and _tail
# at 14 rows x 1 query in the timed run: a 4.9 s stall) with the serving loop's prefill warm-up
# (RolloutEngine.warm_prefill). Predicted: no "Recompiling" line after "untimed run done", the first probe well under
# 1 s, the 3-turn p99 near the p50. Then the 6-turn served run if time is left (call 2: x2.18 p50).
source bench/device/lib.sh
export PYTHONPATH=/tmp/site:src
TORCH_LOGS="recompiles" timeout -k 5 170 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b \
    --dtype bfloat16 --mixed --probe --repeats 1 --turns 3 --min-tokens 16 --max-tokens 512 \
    --prefix-cache-tokens 131072 --modes in-process --client-procs 8 --json $OUT/serve_t3_warm_s38.json > $OUT/serve_t3_warm_s38.txt 2>&1
echo "rc $? ($SECONDS s)"
grep -n "untimed run\|timed run\|Recompiling\|slowest\|x1\.\|x2\.\|tok/s" $OUT/serve_t3_warm_s38.txt | cut -c1-220 | head -30
[ $SECONDS -lt 110 ] && serve new served $((265 - SECONDS))
echo "== done ($SECONDS s)"
