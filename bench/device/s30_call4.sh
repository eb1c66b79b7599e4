#!/bin/bash
# Session 30 call 4 (~9 min, H200; carry [".v", ".whl"]). The prompt part's programs (blocks.PROMPT_PROGRAMS, new:
# the kernel step's prompt part only). Session 25's kernel bench had 264 programs -2.7 us a layer at 64 rows and -15
# at 1,024 rows; its two end-to-end checks disagreed, and the second (call 4) patched decode_attention.TARGET_PROGRAMS,
# which split_attention's default had bound at import: it ran 528 twice. Here the patch is checked (the prompt part's
# key ranges are printed). Predicted: 64 rows +2..4%, 1,024 rows +2..3% at 264. Also the last-tile trim at 1,024 rows
# (against .v/base = 10766c2): predicted +3..5%.
source bench/device/lib.sh
export PYTHONPATH=src
echo "== attention kernels ($SECONDS s)"
timeout -k 5 80 python3 bench/decode_kernels.py --kernels attention --attention-cases 8x8:16,8x8:256,64x16:256 \
    --prompt-targets 528,264,132 --out $OUT/attention_targets.json > $OUT/attention_targets.txt 2>&1
grep -v "$F" $OUT/attention_targets.txt | grep "'attention'\|Error\|error" | cut -c1-250
# rollout_at TARGET CASES [base]: bench_rollout with the prompt part's programs patched (lib.sh's `patched`)
rollout_at() {
  local s=src d=.; [ "$3" = base ] && s=.v/base/src && d=.v/base
  PYTHONPATH=$s patched 100 $1 $d/bench/bench_rollout.py --device cuda --cases $2 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_${1}_${3}_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error\|prompt part" | cut -c1-200
}
for t in 528 264 528 264; do [ $SECONDS -lt 250 ] && { echo "== 64 rows, $t ($SECONDS s)"; rollout_at $t 0.6b:8x8; }; done
for t in 528 264; do [ $SECONDS -lt 400 ] && { echo "== 1,024 rows, $t ($SECONDS s)"; rollout_at $t 0.6b:64x16; }; done
[ $SECONDS -lt 460 ] && { echo "== 1,024 rows, base ($SECONDS s)"; rollout_at default 0.6b:64x16 base; }
echo "== tests at 264 ($SECONDS s)"
[ $SECONDS -lt 500 ] && timeout -k 5 $((585 - SECONDS)) python3 -c "
import sys, pytest, treerl.rollout.blocks as b
b.PROMPT_PROGRAMS = 264
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/cuda/test_rollout_cuda.py', '-k', 'overlap or merged or graph_decode or bf16']))" \
    > $OUT/tests264.txt 2>&1
grep "^E \|passed\|failed\|^FAILED" $OUT/tests264.txt | head -12 | cut -c1-250
echo "== done ($SECONDS s)"
