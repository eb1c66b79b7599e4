#!/bin/bash
# Session 17 call 4 (~8 min, H200). Carry [".whl"]. At most 8 files under $OUT.
# Main after call 3: the merged own part back to 64-key tiles everywhere (call 3: 128-key tiles no change end to end,
# slower on 64 x 2,048); prefill windows at half the decode step's programs (window_attention.WINDOW_TARGET = 264;
# call 3: faster or equal on all six kernel shapes); `treerl serve` freezes its start-up objects out of the
# collector's passes (call 3's base served run had one 0.39 s full pass in its timed run).
# (1) CUDA tests of the changed paths (the 128-key tiles as a kernel option, the window attention, prefills).
# (2) prefill_attention.py: "window" (the default) should equal call 3's w264 figures (29.3 / 28.5 / 46.5 / 186 us).
# (3) bench_serve in process + served (8 client procs), twice if time allows (the run-to-run spread of the probe's
#     ratio: calls 1 and 3 gave x2.18-x2.39 served on main). Predicted: tokens/s and ratios within that spread
#     (prefill windows ~0.06 ms a step); served: no full GC pass in the timed run (/health's gc passes[2] = 0).
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=src:tests timeout -k 5 110 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/rollout/test_rollout_paging.py tests/rollout/test_rollout_window_attention.py tests/cuda/test_rollout_cuda.py \
    -k "wide or window or prefill_graphs or block_table" > $OUT/cuda_tests.txt 2>&1
grep "passed\|failed\|FAILED\|ERROR\|assert" $OUT/cuda_tests.txt | cut -c1-300 | tail -6
PYTHONPATH=src timeout -k 5 40 python3 bench/prefill_attention.py --out $OUT/prefill_attention.json > $OUT/prefill_attention.txt 2>&1
grep -v "$F" $OUT/prefill_attention.txt | grep " us \|Error" | grep "window\|w528" | cut -c1-110
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
show() { grep -v "$F" $1 | grep "in-process\|served\|ratio\|Error\|error\|treerl from" | cut -c1-250; }
for i in 1 2; do
  [ $i = 2 ] && [ $SECONDS -gt 330 ] && { echo "no time for run 2 ($SECONDS s)"; break; }
  PYTHONPATH=/tmp/site:src timeout -k 5 190 python3 bench/bench_serve.py $ARGS --modes in-process,served \
      --client-procs 8 --json $OUT/serve_$i.json > $OUT/serve_$i.txt 2>&1
  echo "== run $i ($SECONDS s)"; show $OUT/serve_$i.txt
done
