#!/bin/bash
# Session 17 call 3 (~8 min, H200). Carry [".whl", ".v"], .v/base = git archive 003c7b6 src bench (main before
# session 17's change). At most 8 files under $OUT.
# (1) serve_attention.py: the merged own part's default (128-key tiles past 1,024 keys) against 64-key tiles, ranges
#     with either tile, and a 64 x 2,048 equal-length case. Predicted: the default = call 2's 128-tile figures
#     (~96 us served, ~74 us 20 long rows); 64 x 2,048 unknown (if slower than 64-key tiles, LONG_KEYS must change).
# (2) prefill_attention.py: window targets 66/132/264 against 528 (fewer float32 partials). Predicted: the
#     1 x 64 x 4,096 bucket (the served run's commonest) from ~30 us (split 22 + merge 7.6 in call 1's profile) to
#     ~15 us at 132.
# (3) bench_serve in-process + served (8 client procs), this commit then 003c7b6. Predicted: decode attention
#     2.81 -> ~2.62 ms a step (28 x 7 us), tokens/s +3-4%, served probe p50 x2.18 -> ~x2.1.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=src timeout -k 5 80 python3 bench/serve_attention.py --out $OUT/serve_attention.json > $OUT/serve_attention.txt 2>&1
grep -v "$F" $OUT/serve_attention.txt | grep " us \|resources\|Error" | grep -v "alone\|44 live of 44" | cut -c1-125
PYTHONPATH=src timeout -k 5 50 python3 bench/prefill_attention.py --out $OUT/prefill_attention.json > $OUT/prefill_attention.txt 2>&1
grep -v "$F" $OUT/prefill_attention.txt | grep " us \|Error" | cut -c1-110
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
show() { grep -v "$F" $1 | grep "in-process\|served\|ratio\|Error\|error\|treerl from" | cut -c1-250; }
for v in new base; do
  s=src; b=bench; [ $v = base ] && s=.v/base/src && b=.v/base/bench
  PYTHONPATH=/tmp/site:$s timeout -k 5 215 python3 $b/bench_serve.py $ARGS --modes in-process,served \
      --client-procs 8 --json $OUT/serve_$v.json > $OUT/serve_$v.txt 2>&1
  echo "== $v"; show $OUT/serve_$v.txt
done
