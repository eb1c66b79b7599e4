#!/bin/bash
# Next session, first call (~8 min, H200; carry [".dta"], made by scripts/get_dta.sh). Session 34 measured issue 24's
# episodes shape 17% slower after five other shapes in one process (6.707 s, 44.9% of peak, 1.99x DTA) than alone
# (5.62-5.74 s, 52.4-53.2%, 2.32x), with the same plan and 2 GiB less peak memory. Hypothesis (from the code, not
# measured): the process's cuDNN plans were used up (engine/chain_attention.CUDNN_MAX_SHAPES = 64 distinct shapes a
# process; the grad check and the earlier shapes' auto and dfs calls took them), so episodes' chain and group parts
# ran through flash, and calls that would take the root split kept the tree mask. A training run whose trees change
# every step would fill the 64 the same way within a few steps. Test: the six shapes, auto and dfs, in one process
# with session 34's policy (64 shapes a process, no per-call bound) and with session 35's default (8 new shapes
# an engine call, 1,024 a process); dta_compare records per row the cuDNN/flash shapes seen so far
# (`attention_shapes`) and torch.compile's counters (`compile`).
source bench/device/lib.sh
export PYTHONPATH=src
ls .dta/tree_training_engine.py || { echo ".dta/ did not travel"; exit 2; }
for cap in 64 default; do
  sets="CUDNN_MAX_SHAPES=64 CUDNN_NEW_SHAPES_PER_CALL=None"; [ $cap = default ] && sets=""
  with_module 250 treerl.engine.chain_attention "$sets" bench/dta_compare.py --engines auto,dfs \
      --no-grad-check --repeats 2 --memory-budget 0.141 --max-seconds 220 --out $OUT/six_cap${cap}_s35.json \
      > $OUT/six_cap${cap}_s35.log 2>&1
  echo "== cap $cap ($SECONDS s)"; grep "settings\|^| " $OUT/six_cap${cap}_s35.log | cut -c1-200
done
python3 - <<'PY'
import json, os
for cap in ("64", "default"):
    p = os.path.join(os.environ["OUT"], f"six_cap{cap}_s35.json")
    if os.path.exists(p):
        for r in json.load(open(p))["rows"]:
            print(cap, r["shape"], r["engine"], r.get("times"), r.get("peak_gib"), r.get("attention_shapes"),
                  r.get("compile"))
PY
echo "== done ($SECONDS s)"
