#!/bin/bash
# Device call (session 2): which suspect makes the compiled + recomputed CUDA test's gradients wrong after the
# preceding CUDA tests (bench/gradbug_probe.py: one process, variants each switching one suspect off).
export PYTHONPATH=src:tests:tests/cuda PYTHONUNBUFFERED=1
timeout 400 python3 bench/gradbug_probe.py 2>&1 | grep -E "^\[|^    |prelude|PASS|FAIL|Error" | tee $OUT/gradbug.log | tail -90
timeout 150 python3 bench/gradbug_probe.py --no-prelude --variants as-is 2>&1 | grep -E "^\[|^    |PASS|FAIL|Error" | tee $OUT/gradbug_alone.log | tail -25
