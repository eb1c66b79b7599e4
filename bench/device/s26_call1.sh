#!/bin/bash
# Session 26 call 1 (~9.5 min, H200): the small-row product kernels (rollout/small_products.py) for issues 25 / 23.
# (1) their GPU tests; (2) the layer's products alone (decode_kernels.py --kernels products: the tail after attention
#     and the Q/K/V product, cuBLAS against the kernels, over 28 layers' weights a replay); (3) bench_rollout 8x8
#     (64 rows) alternating with main (.v/base = f5af947), the small products' tile defaults untuned; (4) if time
#     remains, each product alone over its tiles (the sweep) at 64 rows.
# Predicted (from session 7's H100 kernels at 64 rows and session 25's H200 profile): the tail -6..-9 us a layer, the
# Q/K/V product -0..-2 us; the 64-row step -0.15..-0.3 ms (2.35 ms): 27.2k -> 29-31k tok/s (0.40 -> 0.43-0.46).
source bench/device/lib.sh
export PYTHONPATH=src
echo "== tests ($SECONDS s)"
timeout -k 5 170 python3 -m pytest -q -x -p no:cacheprovider tests/rollout/test_small_products.py \
    tests/cuda/test_rollout_cuda.py -k "small or overlapped_decode or graph_decode_matches or rope_write" 2>&1 | tail -6
echo "== products ($SECONDS s)"
timeout -k 5 120 python3 bench/decode_kernels.py --kernels products --product-rows 16,64,128 --out $OUT/products.json 2>&1 \
    | grep -v "$F" | cut -c1-220
for v in new base new base; do
  [ $SECONDS -gt 430 ] && break
  echo "== rollout $v ($SECONDS s)"; rollout $v
done
if [ $SECONDS -lt 440 ]; then
  echo "== sweep ($SECONDS s)"
  timeout -k 5 $((585 - SECONDS)) python3 bench/decode_kernels.py --kernels products --product-rows 64 --product-sweep \
      --out $OUT/products_sweep.json > $OUT/sweep.txt 2>&1
  python3 - <<'PY'
import ast, os
rows = [ast.literal_eval(l) for l in open(os.environ["OUT"] + "/sweep.txt") if l.startswith("{'kernel': 'product'")]
for p in ("qkv", "o", "gate_up", "down"):
    r = [x for x in rows if x.get("product") == p and "us" in x]
    base = [x["us"] for x in r if x["way"] == "cublas"]
    best = sorted((x for x in r if x["way"] == "small"), key=lambda x: x["us"])[:4]
    print(p, "cublas", base, "best", [(x["us"], x["block_n"], x["splits"], x["num_warps"], x["num_stages"]) for x in best])
PY
fi
echo "== done ($SECONDS s)"
