#!/bin/bash
# Session 19 call 3 (~5 min, H200). Carry [".whl"].
# Call 2: with float8 K/V the own-part split kernel took 3.67 ms a step (2,201.5 ms / 600) against bf16's 2.76
# (session 18): half the bytes, 1.3x the time (1.48 TB/s). Suspected: the widened tiles go registers -> shared
# memory for the products, outside the loads' asynchronous pipeline. serve_attention.py times the merged kernel on
# the serving shapes with bf16 pools (the default settings) and float8 pools over tile settings (deeper pipelines,
# 8 warps, 128-key tiles). Predicted: if a setting pipelines the float8 loads, it reaches <= 0.6x bf16's time.
source bench/device/lib.sh
PYTHONPATH=src:tests timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/cuda/test_kv_fp8_cuda.py -k copy > $OUT/cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert\|Error\|disagree" $OUT/cuda_tests.txt | cut -c1-300 | tail -4
for kv in auto fp8; do
  PYTHONPATH=src timeout -k 5 170 python3 bench/serve_attention.py --kv-dtype $kv --out $OUT/serve_attention_$kv.json \
      > $OUT/serve_attention_$kv.txt 2>&1
  echo "== $kv ($SECONDS s)"; grep -v "$F" $OUT/serve_attention_$kv.txt | grep " us \|Error\|resources" | grep -v "split " | cut -c1-130
done
