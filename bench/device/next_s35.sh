#!/bin/bash
# Next session, first call (~6 min, H200; carry [".dta"], made by scripts/get_dta.sh). Session 34 measured issue 24's
# episodes shape 17% slower after five other shapes in one process (6.707 s, 44.9% of peak, 1.99x DTA) than alone
# (5.62-5.74 s, 52.4-53.2%, 2.32x), with the same plan and 2 GiB less peak memory. dta_compare.py now records
# torch.compile's counters per row (`compile`: graphs, recompiles, graph breaks): (1) the six shapes, auto only, in one
# process; (2) episodes alone; then compare each row's compile counters and the two episodes times.
source bench/device/lib.sh
export PYTHONPATH=src
ls .dta/tree_training_engine.py || { echo ".dta/ did not travel"; exit 2; }
timeout -k 5 260 python3 bench/dta_compare.py --engines auto --no-grad-check --repeats 2 --memory-budget 0.141 \
    --max-seconds 230 --out $OUT/six_auto_s35.json > $OUT/six_auto_s35.log 2>&1
grep "^| " $OUT/six_auto_s35.log | cut -c1-200
timeout -k 5 200 python3 bench/dta_compare.py --shapes episodes --engines auto --no-grad-check --repeats 3 \
    --row-seconds 40 --memory-budget 0.141 --out $OUT/episodes_alone_s35.json > $OUT/episodes_alone_s35.log 2>&1
grep "^| episodes" $OUT/episodes_alone_s35.log
python3 - <<'PY'
import json, os
for f in ("six_auto_s35.json", "episodes_alone_s35.json"):
    p = os.path.join(os.environ["OUT"], f)
    if os.path.exists(p):
        for r in json.load(open(p))["rows"]:
            print(f, r["shape"], r.get("times"), r.get("peak_gib"), r.get("compile"))
PY
echo "== done ($SECONDS s)"
