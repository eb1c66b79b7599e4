#!/bin/bash
# Session 37, call 1 (~3 min, H200): does the decode step at 1,024 rows gain from two-batch overlap (half the rows'
# attention beside the other half's products on a second stream)? bench/device/tbo_probe.py's docstring has the
# prediction; its rows: us a layer over 28 layers' own buffers.
source bench/device/lib.sh
export PYTHONPATH=src
timeout -k 5 400 python3 bench/device/tbo_probe.py --out $OUT/tbo_probe_s37_call1.json > $OUT/tbo_probe_s37_call1.log 2>&1
echo "rc $? ($SECONDS s)"; grep -v "$F" $OUT/tbo_probe_s37_call1.log | cut -c1-900 | tail -20
