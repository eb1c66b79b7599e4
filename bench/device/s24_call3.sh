source bench/device/lib.sh
for v in new base new; do
  d=.; [ $v = base ] && d=.v/base
  echo "== rollout $v ($SECONDS s)"
  timeout -k 5 110 python3 $d/bench/bench_rollout.py --device cuda --cases 0.6b:8x8,0.6b:64x16 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_${v}_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
done
echo "== profile ($SECONDS s)"
PYTHONPATH=src timeout -k 5 $((400 - SECONDS)) python3 bench/profile_rollout.py --cases 0.6b:64x16,0.6b:8x8 --new-tokens 512 \
    --out $OUT/profile_rollout_new.json 2>&1 | grep -v "$F" | grep "==\|ms/step\| ms \|Error" | head -40 | cut -c1-160
