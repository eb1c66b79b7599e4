#!/bin/bash
# Session 26 call 2 (~9.5 min, H200; carry [".v", ".whl"]): the small-row products with call 1's tiles (4 stages, the
# gated kernel in 32-column tiles) and the Q/K/V product back on cuBLAS. (1) GPU tests (their output kept whole);
# (2) bench_rollout 8x8 (64 rows) against main (.v/base = f5af947), alternating; (3) the GRPO step against main;
# (4) the per-product sweep with inner tiles of 64/128/256.
# Predicted: 64 rows 29.1k (call 1) -> 29.5-30.0k tok/s (Q/K/V on cuBLAS -0.024 ms, the tiles -0.03 ms a step);
# the GRPO step 2.06 -> ~1.99 s (rollout -0.07 s).
source bench/device/lib.sh
export PYTHONPATH=src
echo "== tests ($SECONDS s)"
timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_small_products.py \
    tests/cuda/test_rollout_cuda.py -k "small or overlapped_decode or graph_decode_matches or per_group or graph_trees" \
    > $OUT/tests.txt 2>&1
grep "^E \|passed\|failed\|^FAILED" $OUT/tests.txt | head -20
rollout() {  # rollout VERSION
  local d=.; [ $1 = base ] && d=.v/base
  PYTHONPATH=$d/src timeout -k 5 90 python3 $d/bench/bench_rollout.py --device cuda --cases 0.6b:8x8 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_$1_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
}
for v in new base new base; do
  [ $SECONDS -gt 330 ] && break
  echo "== rollout $v ($SECONDS s)"; rollout $v
done
grpo_steps 400 520 1 new base
if [ $SECONDS -lt 520 ]; then
  echo "== sweep ($SECONDS s)"
  timeout -k 5 $((590 - SECONDS)) python3 bench/decode_kernels.py --kernels products --product-rows 64 --product-sweep \
      --out $OUT/products_sweep.json > $OUT/sweep.txt 2>&1
  grep "products-tail" $OUT/sweep.txt | cut -c1-200
  python3 - <<'PY'
import ast, os
rows = [ast.literal_eval(l) for l in open(os.environ["OUT"] + "/sweep.txt") if l.startswith("{'kernel': 'product'")]
for p in ("qkv", "o", "gate_up", "down"):
    r = [x for x in rows if x.get("product") == p and "us" in x]
    base = [x["us"] for x in r if x["way"] == "cublas"]
    best = sorted((x for x in r if x["way"] == "small"), key=lambda x: x["us"])[:4]
    print(p, "cublas", base, "best", [(x["us"], x["block_n"], x["splits"], x["block_k"], x["num_warps"], x["num_stages"])
                                      for x in best])
PY
fi
echo "== done ($SECONDS s)"
