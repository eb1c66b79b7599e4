#!/bin/bash
# Session 29 call 1 (~8 min, H200). The decode attention's two launches at 64 rows are latency-bound: sm_90 SASS/PTX
# of the merged own part (2 stages, the default) waits on every copy at the top of each key tile (cp.async.wait_group
# 0) and issues the next tile's copies after the tile's products: the tiles run one after another, one DRAM round trip
# each (4 tiles at 256 own keys; the prompt part's programs 2 tiles). At 3 stages the next tile is in flight during a
# tile (wait_group 1) and registers drop 116 -> 89. Predicted: the own part alone at 64 rows x 256 keys 26.4 ->
# 18-21 us a layer, the pair 37.4 -> 30-33; bench_rollout at 64 rows +5..9%.
# (1) the sweep of both parts' settings at 64 and 1,024 rows; (2) bench_rollout at 64 rows with the stages patched
# (RANGE_STAGES / MERGED_STAGES), alternating; 1,024 rows at 2/2 and 3/3; (3) the small products at 16/32 rows.
# (RANGE_STAGES / MERGED_STAGES, which this script patches, were removed in the session's review: the stages are the
# launches' num_stages defaults again, 2.)
source bench/device/lib.sh
export PYTHONPATH=src
echo "== attention sweep ($SECONDS s)"
timeout -k 5 200 python3 bench/decode_kernels.py --kernels attention \
    --attention-cases 8x8:16,8x8:256,8x8:512,64x16:32,64x16:256 \
    --attention-sweep own:64:3:4,own:64:4:4,own:32:3:4,own:32:4:4,own:32:6:4,own:64:3:8,prompt:64:3:4,prompt:64:4:4,prompt:128:2:4,prompt:128:3:4,prompt:32:4:4 \
    --out $OUT/attention_sweep_s29_call1.json > $OUT/sweep.txt 2>&1
grep -v "$F" $OUT/sweep.txt | grep "kernel\|Error\|error" | cut -c1-260
staged() {  # staged RANGE MERGED CASES: bench_rollout with the decode attention's stages patched
  echo "== rollout stages $1/$2 $3 ($SECONDS s)"
  timeout -k 5 80 python3 -c "
import runpy, sys
sys.path.insert(0, 'src')
import treerl.rollout.decode_attention as d
d.RANGE_STAGES, d.MERGED_STAGES = int(sys.argv[1]), int(sys.argv[2])
sys.argv = ['bench/bench_rollout.py'] + sys.argv[3:]
runpy.run_path('bench/bench_rollout.py', run_name='__main__')" $1 $2 --device cuda --cases $3 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_stages$1$2_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
}
for s in "2 2" "3 3" "4 4" "2 2" "3 3" "2 3" "3 2"; do [ $SECONDS -lt 420 ] && staged $s 0.6b:8x8; done
for s in "2 2" "3 3"; do [ $SECONDS -lt 480 ] && staged $s 0.6b:64x16; done
echo "== products 16,32 ($SECONDS s)"
[ $SECONDS -lt 500 ] && timeout -k 5 80 python3 bench/decode_kernels.py --kernels products \
    --product-rows 16,32 --product-sweep --out $OUT/products_sweep_16_32_s29_call1.json > $OUT/psweep.txt 2>&1
grep -v "$F" $OUT/psweep.txt | grep "tail" | cut -c1-200
echo "== done ($SECONDS s)"
