#!/bin/bash
# Session 32, call 3 (<= 7 min, H200; no carry). The sampling race's launch settings (race_kernel: TARGET_PROGRAMS 528,
# BLOCK 2048, NUM_WARPS 8 since session 24) swept alone at 64 and 1,024 rows (bf16, T = 1; the tokens are the same
# bits at every setting); the best by the sum of both rows' times, if >= 3% faster at each, then in bench_rollout
# against the defaults (1,024 rows twice each, alternating; 64 rows once each). Predicted: at 64 rows 576 programs
# make 4.4 waves of 132 SMs (the last wave 15% short); a balanced or fuller setting -5..-15% of the race's 47 / 658 us,
# bench_rollout +0.2..0.6%.
source bench/device/lib.sh
export PYTHONPATH=src
echo "== race sweep ($SECONDS s)"
timeout -k 5 140 python3 bench/decode_kernels.py --kernels race --race-rows 64,1024 --race-sweep \
    --out $OUT/race_sweep_s32_call3.json > $OUT/race_sweep.txt 2>&1
BEST=$(python3 - $OUT/race_sweep_s32_call3.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
sweep = [r for r in rows if r["kernel"] == "race-sweep"]
assert all(r["tokens_equal_reference"] for r in sweep), "a setting's tokens differ from the reference"
key = lambda r: (r["TARGET_PROGRAMS"], r["BLOCK"], r["NUM_WARPS"])
us = {}
for r in sweep:
    us.setdefault(key(r), {})[r["rows"]] = r["us"]
default = us[(528, 2048, 8)]
for k, v in sorted(us.items(), key=lambda kv: sum(kv[1][n] / default[n] for n in default))[:6]:
    print(f"  {k}: " + ", ".join(f"{n} rows {v[n]} us ({v[n] / default[n]:.3f})" for n in sorted(v)), file=sys.stderr)
best = min(us, key=lambda k: sum(us[k][n] / default[n] for n in default))
if all(us[best][n] <= 0.97 * default[n] for n in default):
    print(f"TARGET_PROGRAMS={best[0]} BLOCK={best[1]} NUM_WARPS={best[2]}")
PY
)
grep -v "$F" $OUT/race_sweep.txt | grep "Error\|error\|assert" | head -5
echo "best: '${BEST}'"
if [ -n "$BEST" ]; then
  for s in default best default best; do
    echo "== rollout 1,024 rows $s ($SECONDS s)"
    sets=""; [ $s = best ] && sets="$BEST"
    [ $SECONDS -lt 290 ] && with_module 75 treerl.rollout.race_kernel "$sets" bench/bench_rollout.py --device cuda \
        --cases 0.6b:64x16 --extras "" --bandwidth 4.277e12 --out $OUT/rollout1024_race_${s}_$SECONDS.json 2>&1 \
        | grep -v "$F" | grep "^0.6b\|settings\|FAILED\|Error" | cut -c1-200
  done
  for s in default best; do
    echo "== rollout 64 rows $s ($SECONDS s)"
    sets=""; [ $s = best ] && sets="$BEST"
    [ $SECONDS -lt 370 ] && with_module 60 treerl.rollout.race_kernel "$sets" bench/bench_rollout.py --device cuda \
        --cases 0.6b:8x8 --extras "" --bandwidth 4.277e12 --out $OUT/rollout64_race_${s}_$SECONDS.json 2>&1 \
        | grep -v "$F" | grep "^0.6b\|settings\|FAILED\|Error" | cut -c1-200
  done
fi
echo "== done ($SECONDS s)"
