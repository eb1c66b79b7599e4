#!/bin/bash
# Prepared in session 28 for the next one (~9 min, H200 or H100; carry [".v", ".whl"]; first, here:
#   rm -rf .v && mkdir -p .v/base && git archive bf0d533 src bench | tar -x -C .v/base   (main before session 28)
# (1) issue 23 in process, two alternating pairs (session 28 call 2: +4.7% in one pair with the products' TMA tiles;
#     the spread between runs of one code is ~4%), then served once, after the in-process runs have warmed the compile
#     caches (session 28 call 3's served run, first on a fresh machine, spent its 110 s compiling);
# (2) each small product alone over its tiles at 16 and 32 rows (the TMA kernels' 5 stages were measured at 64 rows
#     only; serving's steps run at 16-64 rows).
source bench/device/lib.sh
serve base in-process 80
serve new in-process 80
serve base in-process 80
serve new in-process 80
[ $SECONDS -lt 400 ] && serve new served 150
echo "== sweep ($SECONDS s)"
[ $SECONDS -lt 480 ] && PYTHONPATH=src timeout -k 5 100 python3 bench/decode_kernels.py --kernels products \
    --product-rows 16,32 --product-sweep --out $OUT/products_sweep_16_32.json > $OUT/sweep.txt 2>&1
grep -v "$F" $OUT/sweep.txt | grep "tail" | cut -c1-200
echo "== done ($SECONDS s)"
