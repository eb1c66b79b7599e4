#!/bin/bash
# Session 19 call 1 (~9.5 min, H200). Carry [".whl"].
# New this session: RolloutEngine(kv_cache_dtype="fp8") / treerl serve --kv-cache-dtype fp8 keep the running batch's
# K/V in float8 e4m3 (opt-in, not exact; CPU-exact against a float64 forward over rounded K/V).
# (1) CUDA tests: the fp8 kernels (split/merged attention reading float8 pools, the copy kernel converting, the rope
#     kernel writing) and the engine against the rounded reference; the default paths' rope/merged/split tests.
# (2) bench_serve (64 agents x 6 turns, mixed 16-512 tokens, probe; in process + served, 8 client procs) with
#     --kv-cache-dtype fp8, then auto (the same code's default) in the same call.
#     Predicted: the own-part attention reads half the bytes (10.85 -> 5.4 GB a step; at ~3.9 TB/s 2.76 -> ~1.4-1.6
#     ms), the busy step ~4.5 -> ~3.3 ms of device time, tokens/s +25-35%, the probe's p50 ratio x2.2-2.5 -> ~x1.7-1.9.
source bench/device/lib.sh
PYTHONPATH=src:tests timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/cuda/test_kv_fp8_cuda.py tests/cuda/test_rollout_cuda.py -k "fp8 or rope or merged or split" \
    > $OUT/cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert\|Error" $OUT/cuda_tests.txt | cut -c1-300 | tail -10
echo "tests done at $SECONDS s"
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
for kv in fp8 auto; do
  [ $kv = auto ] && [ $SECONDS -gt 370 ] && { echo "no time for auto ($SECONDS s)"; break; }
  PYTHONPATH=/tmp/site:src timeout -k 5 200 python3 bench/bench_serve.py $ARGS --kv-cache-dtype $kv \
      --modes in-process,served --client-procs 8 --json $OUT/serve_$kv.json > $OUT/serve_$kv.txt 2>&1
  echo "== $kv ($SECONDS s)"; show $OUT/serve_$kv.txt
done
