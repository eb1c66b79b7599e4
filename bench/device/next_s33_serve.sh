#!/bin/bash
# Next session, a call for issue 23's status (~6 min, H200; first `bash bench/device/wheels.sh` here, then carry
# [".whl"]). Not measured since session 30 (x2.16 served): sessions 31-32's changes in the served steps are the Q/K/V
# link at 64-128 rows (the served steps' buckets are powers of two: 44 live rows of up to 65 requests run at 64 or
# 128, so the chain may serve them; check the printed counters). In process the probe's latency is now split at its
# first token: the p50 first token and rest, alone and behind, say which part the agents lengthen.
source bench/device/lib.sh
export PYTHONPATH=src
serve new in-process 200
serve new served 260
echo "== done ($SECONDS s)"
