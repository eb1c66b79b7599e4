#!/bin/bash
# Session 20 call 3 (~9.5 min, H200). Carry [".whl", ".v"]: .v/c1 = f7ffd2a (the prefix cache's integer ids, call 2:
# in process 10,420 against 10,199 tok/s before), .v/c2 = a62a56e (+ reads of the decode log finished 2 decode steps
# after they start: READ_LAG), the working tree = c3 (+ small uploads through a pinned ring: PinnedStaging).
# Predicted: c2 +4..+8% tokens/s in process over c1 (the device's idle of ~0.4-1.1 ms a step in admissions and reads
# mostly gone), the probe's p50 ratio -0.05..-0.15 (each request's end is read one host turn later, alone too);
# c3 a further +1..+2%. (0) the new CUDA test of the ring and the overlap test fixed after call 1; (1) in process c1,
# c2, c3; (2) served c3; (3) the rollout CUDA tests (the engine against float64 with the new reads and uploads).
source bench/device/lib.sh
PYTHONPATH=src:tests timeout -k 5 80 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/cuda/test_pinned_staging_cuda.py \
    "tests/cuda/test_overlap_cuda.py::test_launching_a_groups_forwards_does_not_synchronise_the_host" > $OUT/cuda_0.txt 2>&1
echo "== cuda 0 ($SECONDS s)"; grep "passed\|failed\|FAILED\|Error" $OUT/cuda_0.txt | cut -c1-250 | tail -5
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
for v in c1 c2; do
  PYTHONPATH=/tmp/site:.v/$v/src timeout -k 5 110 python3 .v/$v/bench/bench_serve.py $ARGS --modes in-process --json $OUT/${v}_inproc.json > $OUT/${v}_inproc.txt 2>&1
  echo "== $v in-process ($SECONDS s)"; show $OUT/${v}_inproc.txt | grep -v slowest
done
PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 bench/bench_serve.py $ARGS --modes in-process --json $OUT/c3_inproc.json > $OUT/c3_inproc.txt 2>&1
echo "== c3 in-process ($SECONDS s)"; show $OUT/c3_inproc.txt | grep -v slowest
PYTHONPATH=/tmp/site:src timeout -k 5 130 python3 bench/bench_serve.py $ARGS --modes served --client-procs 8 --json $OUT/c3_served.json > $OUT/c3_served.txt 2>&1
echo "== c3 served ($SECONDS s)"; show $OUT/c3_served.txt | grep -v slowest
PYTHONPATH=src:tests timeout -k 5 $((585 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short -x \
    tests/cuda/test_rollout_cuda.py > $OUT/cuda_rollout.txt 2>&1
echo "== cuda rollout ($SECONDS s)"; grep "passed\|failed\|FAILED\|Error\|assert" $OUT/cuda_rollout.txt | cut -c1-250 | tail -6
