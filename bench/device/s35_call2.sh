#!/bin/bash
# Session 35, second call (~8 min, H200): what a new cuDNN shape costs (plan ms, host memory kept; sets
# chain_attention's CUDNN_NEW_SHAPES_PER_CALL / CUDNN_MAX_SHAPES), and issue 24 item 4 (the first forward_backward
# of a process: cold, with the compile cache kept, with only the artifacts file) at this code, last measured in
# session 4 on an H100. Then the CUDA tests of the cuDNN bound.
source bench/device/lib.sh
export PYTHONPATH=src
timeout -k 5 100 python3 bench/cudnn_plans.py --out $OUT/cudnn_plans_s35.json > $OUT/cudnn_plans_s35.log 2>&1
echo "== plans ($SECONDS s)"; tail -2 $OUT/cudnn_plans_s35.log | cut -c1-400
timeout -k 5 400 python3 bench/first_step.py --out $OUT/first_step_s35.json > $OUT/first_step_s35.log 2>&1
echo "== first step ($SECONDS s)"; tail -12 $OUT/first_step_s35.log | cut -c1-300
timeout -k 5 60 python3 -m pytest -q -m cuda tests/cuda/test_chain_attention_cuda.py -k "shape_bound or planned" \
    > $OUT/tests_s35_call2.txt 2>&1
echo "== tests ($SECONDS s)"; tail -3 $OUT/tests_s35_call2.txt
