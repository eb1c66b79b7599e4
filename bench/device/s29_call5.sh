#!/bin/bash
# Session 29 call 5 (~3 min, H200; carry [".v"], .v/base = the tree before this change): the split kernel's last tile
# no longer loads the keys past the range's last visible one (~32 of a row's keys a step in blocks of 64; at a mean
# of 256 own keys ~12% of the own part's bytes). Predicted: bench_rollout at 64 rows +1.5..3%.
source bench/device/lib.sh
for v in new base; do echo "== rollout $v ($SECONDS s)"; rollout $v; done
echo "== done ($SECONDS s)"
