#!/bin/bash
# Session 21 call 2 (~9.5 min, H200). Carry [".whl"]. Call 1: the CUDA cores' products were 2.8x slower (not kept);
# the tensor-core kernel's 128-key tiles -8..-22% on served rows of unequal length in the kernel bench, +19% on equal
# ones. Session 17 found 128-key tiles no change end to end, but then the host bounded the step (the device idled
# ~1 ms a step before reads two steps behind). Now (READ_LAG = 2) the step should be device-bound. (1) Where the
# period goes on main now: profile_serve_phases (300 steady steps): device busy vs wall a step, idle by phase.
# (2) The same with the merged own-part kernel at 128-key tiles, (3) at 64-key tiles with 3 stages.
# Predicted: (1) device busy ~= wall (idle < 0.3 ms a step); (2) split kernel -5..-10% a step if the long rows'
# chains bound it, +5..+15% if bandwidth does; (3) within +-5%. (4) The rest of the rollout CUDA tests.
source bench/device/lib.sh
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
phases() {  # name, python statements run first
  PYTHONPATH=/tmp/site:src timeout -k 5 150 python3 -c "import sys, runpy; import treerl.rollout.decode_attention as d; $2; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" \
      bench/profile_serve_phases.py --skip 700 --window 300 --profile-json $OUT/phases_$1.json $ARGS --modes in-process > $OUT/phases_$1.txt 2>&1
  echo "== phases $1 ($SECONDS s)"; grep -v "$F" $OUT/phases_$1.txt | grep "^window\|^device idle\|    idle\|^live rows\|in-process  \|x2\|_split_kernel\|^device in" | cut -c1-150 | head -14
}
phases main "pass"
phases tile128 "d.split_attention_merged.__kwdefaults__.update(block_n=128)"
phases stages3 "d.split_attention_merged.__kwdefaults__.update(num_stages=3)"
PYTHONPATH=src:tests timeout -k 5 $((585 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/cuda/test_rollout_cuda.py > $OUT/cuda_rollout.txt 2>&1
echo "== cuda rollout ($SECONDS s)"; grep "passed\|failed\|FAILED\|Error\|assert\|%\]" $OUT/cuda_rollout.txt | cut -c1-250 | tail -6
