#!/bin/bash
# Session 25, call 4 (~2.5 min, the budget's rest). Calls 2-3: the pair's bench favours the prompt part at 264 programs
# (-2.7 us a layer at 64 rows, -15 at 1,024), bench_rollout measured 264 slower (call 2, one run each). Here: this
# tree's bench_rollout with the prompt part's TARGET_PROGRAMS patched to 264, then at its 528, one run each.
source bench/device/lib.sh
for t in 264 528; do
  echo "== rollout TARGET_PROGRAMS=$t ($SECONDS s)"
  timeout -k 5 75 python3 -c "
import runpy, sys
sys.path.insert(0, 'src')
import treerl.rollout.decode_attention as d
d.TARGET_PROGRAMS = int(sys.argv[1])
sys.argv = ['bench/bench_rollout.py'] + sys.argv[2:]
runpy.run_path('bench/bench_rollout.py', run_name='__main__')" $t --device cuda --cases 0.6b:8x8,0.6b:64x16 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_target${t}.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
done
