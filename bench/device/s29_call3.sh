#!/bin/bash
# Session 29 call 3 (~5 min, H200): call 2's kernel bench passed split_attention_pair its table and own mask swapped
# (its rows: wrong and fast), and its test run hit the 120 s limit without a summary; its rollouts could not say
# whether the engine's probe admitted the one launch. Again: the attention kernels alone (the bench fixed), the one
# launch's CUDA kernel tests, and bench_rollout at 64 rows, one launch / two, printing the probe's answer.
source bench/device/lib.sh
export PYTHONPATH=src
echo "== attention ($SECONDS s)"
timeout -k 5 90 python3 bench/decode_kernels.py --kernels attention --attention-cases 8x8:16,8x8:256,8x8:512,64x16:256 \
    --out $OUT/attention_pair_s29_call3.json > $OUT/attention.txt 2>&1
grep -v "$F" $OUT/attention.txt | grep "kernel\|Error\|error" | cut -c1-230
gpu_tests 100 "pair_launch_equals" tests/cuda/test_rollout_cuda.py
launch() {  # launch one|two CASES: bench_rollout with the attention in one launch, or two (pair_ok patched off)
  echo "== rollout $1 $2 ($SECONDS s)"
  timeout -k 5 70 python3 -c "
import runpy, sys
sys.path.insert(0, 'src')
import treerl.rollout.shared as s
probe = s.pair_ok
def seen(*a, **k):
    r = False if sys.argv[1] == 'two' else probe(*a, **k)
    print('pair_ok', a, r, flush=True)
    return r
s.pair_ok = seen
sys.argv = ['bench/bench_rollout.py'] + sys.argv[2:]
runpy.run_path('bench/bench_rollout.py', run_name='__main__')" $1 --device cuda --cases $2 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_$1_$SECONDS.json > $OUT/r.txt 2>&1
  grep -v "$F" $OUT/r.txt | grep "^0.6b\|FAILED\|Error\|rror\|pair_ok\|disagree" | cut -c1-250 | head -8
}
for v in one two one; do [ $SECONDS -lt 300 ] && launch $v 0.6b:8x8; done
echo "== done ($SECONDS s)"
