#!/bin/bash
# Prepared in session 26 for the next one (~8 min, H200 or H100; carry [".v", ".whl"], first, here:
#   rm -rf .v && mkdir -p .v/base && git archive f5af947 src bench | tar -x -C .v/base   (main before session 26)
# Issue 23's workload (64 agents x 6 turns, max_tokens 16-512, Qwen3-0.6B bf16, prefix cache 131,072) with session 26's
# small-row products, in process against main before them, and served (8 client processes: session 26 measured it
# once, x2.24 p50, without a base row beside it); then the 64-row decode step profiled with them (kernels a step and
# time by kind, for issue 25's profile table). Session 26 in process: +1.4% tokens/s, behind 0.076 -> 0.072 s,
# alone 0.032 -> 0.028 s (one pair): expected again within that.
source bench/device/lib.sh
serve new in-process 110
serve base in-process 110
[ $SECONDS -lt 250 ] && serve new served 130
[ $SECONDS -lt 390 ] && serve base served 130
if [ $SECONDS -lt 480 ]; then
  echo "== profile 64 rows ($SECONDS s)"
  PYTHONPATH=src timeout -k 5 $((585 - SECONDS)) python3 bench/profile_rollout.py --cases 0.6b:8x8 --new-tokens 512 \
      --out $OUT/profile_rollout_64.json 2>&1 | grep -v "$F" | grep "==\|ms/step\| ms \|Error" | head -30 | cut -c1-160
fi
echo "== done ($SECONDS s)"
