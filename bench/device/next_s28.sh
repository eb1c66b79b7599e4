#!/bin/bash
# Prepared in session 27 for the next one (~9 min, H200 or H100; carry [".v", ".whl"], first, here:
#   rm -rf .v && mkdir -p .v/base && git archive ad21e5f src bench | tar -x -C .v/base   (main before session 27)
# Issue 23's workload in process, two alternating pairs (session 27 call 2 measured one pair at -4% for a change that
# leaves every step below 64 rows as it was: expected within +-2% here), then served once; then the 64-row rollout
# pair once more and the 64-row step profiled with the chain (kernels a step, time by kind).
source bench/device/lib.sh
serve base in-process 80
serve new in-process 80
serve base in-process 80
serve new in-process 80
[ $SECONDS -lt 420 ] && serve new served 100
for v in new base; do [ $SECONDS -lt 500 ] && { echo "== rollout $v ($SECONDS s)"; rollout $v; }; done
echo "== done ($SECONDS s)"
