#!/bin/bash
# Session 25, call 2 (~6 min). Call 1 measured the overlap: the pair alone -4 us a layer at 64 rows (predicted ~-13),
# bench_rollout 64 rows +3.9%, 1,024 rows +1.6%, the GRPO step 2.16 -> 2.06 s. Its CUDA tests did not run (no
# PYTHONPATH). Here: the CUDA tests; the pair with the prompt part's programs swept (the own part's run beside it, so
# the prompt part need not fill the GPU alone: fewer, longer ranges, and a shorter merge in the own programs'
# epilogue), predicted -2..-6 us more at 64 rows; bench_rollout at three OVERLAP_TARGET values.
source bench/device/lib.sh
echo "== cuda tests ($SECONDS s)"
PYTHONPATH=src timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider -W ignore tests/cuda/test_rollout_cuda.py \
    -k "overlap or merged_attention or bf16_pending or graph_decode" 2>&1 | tail -12 | cut -c1-300
echo "== attention pair ($SECONDS s)"
PYTHONPATH=src timeout -k 5 90 python3 bench/decode_kernels.py --kernels attention --prompt-targets 528,264,132,66 \
    --out $OUT/attention_pair.json 2>&1 | grep -v "$F" | cut -c1-250
for t in 132 528 264; do
  [ $SECONDS -gt 480 ] && break
  echo "== rollout OVERLAP_TARGET=$t ($SECONDS s)"
  timeout -k 5 100 python3 -c "
import runpy, sys
sys.path.insert(0, 'src')
import treerl.rollout.decode_attention as d
d.OVERLAP_TARGET = int(sys.argv[1])
sys.argv = ['bench/bench_rollout.py'] + sys.argv[2:]
runpy.run_path('bench/bench_rollout.py', run_name='__main__')" $t --device cuda --cases 0.6b:8x8,0.6b:64x16 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_target${t}.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
done
