#!/bin/bash
# Next session, first call (~9 min, H200; carry [".whl"] from bench/device/wheels.sh): session 38's last fix
# (window_attention's output a tensor of its own at one query a row) not yet on a GPU. Issue 23's benchmark at 3 and 6
# turns, in process and served, dynamo's recompiles logged. Predicted: no "Recompiling" line after "untimed run done"
# in any run, the timed runs' first probe ~0.3-0.9 s (session 38 call 7: 1.64 s, one _tail recompile), p50 ratios as
# session 38's (3 turns x1.7-1.9, 6 turns x2.2-2.4).
source bench/device/lib.sh
export PYTHONPATH=/tmp/site:src
for t in 3 6; do
  for m in in-process served; do
    [ $SECONDS -gt 470 ] && break
    echo "== $t turns, $m ($SECONDS s)"
    TORCH_LOGS="recompiles" timeout -k 5 $((590 - SECONDS)) python3 bench/bench_serve.py --device cuda \
        --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns $t --min-tokens 16 --max-tokens 512 \
        --prefix-cache-tokens 131072 --modes $m --client-procs 8 --json $OUT/serve_t${t}_${m}_s39.json > $OUT/serve_t${t}_${m}_s39.txt 2>&1
    grep -n "untimed run\|Recompiling\|slowest\|x1\.\|x2\.\|x3\." $OUT/serve_t${t}_${m}_s39.txt | cut -c1-200 | head -12
  done
done
echo "== done ($SECONDS s)"
