#!/bin/bash
# Session 28 call 3 (~5 min, H200; carry [".v", ".whl"]): with the products' tiles through TMA (call 2: the 64-row
# tail 20.05 -> 18.21 us a layer, bench_rollout +1.9%), (1) each small product alone over its tiles at 64 rows (their
# defaults were chosen for the pointer kernels in session 26; the Q/K/V product too, against cuBLAS); (2) issue 23
# served (8 client processes), new only.
source bench/device/lib.sh
export PYTHONPATH=src
echo "== sweep ($SECONDS s)"
timeout -k 5 150 python3 bench/decode_kernels.py --kernels products --product-rows 64 --product-sweep \
    --out $OUT/products_sweep_s28_call3.json > $OUT/sweep.txt 2>&1
python3 - <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/products_sweep_s28_call3.json"))["results"]
for product in ("qkv", "o", "gate_up", "down"):
    mine = [r for r in rows if r.get("product") == product and "us" in r]
    cublas = [r["us"] for r in mine if r["way"] == "cublas"]
    best = sorted((r for r in mine if r["way"] == "small"), key=lambda r: r["us"])[:4]
    print(product, "cublas", cublas, "best", [(r["us"], r["block_n"], r.get("splits"), r["block_k"], r["num_warps"], r["num_stages"]) for r in best])
for r in rows:
    if r.get("kernel") == "products-tail":
        print(r)
PY
tail -3 $OUT/sweep.txt | cut -c1-200
serve new served 110
echo "== done ($SECONDS s)"
