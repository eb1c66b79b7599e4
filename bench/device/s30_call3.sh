#!/bin/bash
# Session 30 call 3 (~3.5 min, H200). (1) The 64-row decode step's kernel timeline (bench/decode_timeline.py, new):
# where the device idles between kernels (a layer's launches without a programmatic dependent launch: the Q/K/V
# product after the last residual norm, rope after it, the prompt part after rope). Predicted: ~5-8 us of idle a
# layer (the step's 73.6 us a layer against ~66 us of kernels). (2) The race's variants (s30_race_variants.py).
# Predicted from the SASS instruction counts (106 -> 57 / 49 an element): the fast outer log ~0.75x, paired ~0.9x.
source bench/device/lib.sh
export PYTHONPATH=src
timeout -k 5 150 python3 bench/decode_timeline.py --cases 0.6b:8x8,0.6b:64x16 --new-tokens 128 \
    --out $OUT/timeline.json > $OUT/timeline.txt 2>&1
grep -v "$F" $OUT/timeline.txt | head -70 | cut -c1-110
echo "== race variants ($SECONDS s)"
timeout -k 5 120 python3 bench/device/s30_race_variants.py > $OUT/race_variants.txt 2>&1
grep -v "$F" $OUT/race_variants.txt | cut -c1-200 | tail -20
echo "== done ($SECONDS s)"
