#!/bin/bash
# Session 29 call 2 (~8 min, H200): the decode attention's two parts in one launch (split_attention_pair: each group
# and KV head's own programs beside its prompt ranges, the last of them merging, through an atomic count). Call 1's
# sweep: the pipeline's stages change nothing (own part alone 26.4-26.8 us a layer at 64 rows x 256 keys at 2-4
# stages); its fixed cost is ~12 us a launch (16 own keys: 13.0 us), and in the overlapped pair the own programs wait
# for SM slots until the prompt part's 512 programs leave, then for the last of them. Predicted: the pair at 64 rows
# x 256 own keys 37.5 -> 29-32 us a layer; bench_rollout at 64 rows +4..8%; 1,024 rows +0..2%.
# (1) the CUDA tests of the one launch and of the overlap; (2) the attention kernels alone; (3) bench_rollout with the
# one launch against the overlapped pair (shared.pair_ok patched off), alternating; (4) the GRPO step.
source bench/device/lib.sh
export PYTHONPATH=src
gpu_tests 120 "pair_launch or overlapped" tests/cuda/test_rollout_cuda.py
echo "== attention ($SECONDS s)"
timeout -k 5 100 python3 bench/decode_kernels.py --kernels attention \
    --out $OUT/attention_pair_s29_call2.json > $OUT/attention.txt 2>&1
grep -v "$F" $OUT/attention.txt | grep "kernel\|Error\|error" | cut -c1-230
launch() {  # launch one|two CASES: bench_rollout with the attention in one launch, or two (pair_ok patched off)
  echo "== rollout $1 $2 ($SECONDS s)"
  timeout -k 5 80 python3 -c "
import runpy, sys
sys.path.insert(0, 'src')
import treerl.rollout.shared as s
if sys.argv[1] == 'two':
    s.pair_ok = lambda *a, **k: False
sys.argv = ['bench/bench_rollout.py'] + sys.argv[2:]
runpy.run_path('bench/bench_rollout.py', run_name='__main__')" $1 --device cuda --cases $2 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_$1_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error\|rror" | cut -c1-200
}
for v in one two one two; do [ $SECONDS -lt 380 ] && launch $v 0.6b:8x8; done
for v in one two; do [ $SECONDS -lt 450 ] && launch $v 0.6b:64x16; done
grpo_steps 480 570 2 new
echo "== done ($SECONDS s)"
