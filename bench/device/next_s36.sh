#!/bin/bash
# Next session, a call for issue 24 (~9 min, H200): a run whose trees change every step, as an RL run's, at session
# 35's cuDNN policy (8 new shapes an engine call, 512 a process) and at session 34's (64 a process). The CPU
# simulation (bench/cudnn_shapes_sim.py) predicts for long_prefix (32k-token prompts) ~1.1 new shapes a step,
# the 64 used up by step ~25, after which 96% of its one-call steps keep the tree mask under the old policy; with
# the new one every step keeps the root split at ~0.3 s of plans a step. Measure: seconds per step over 30 steps.
source bench/device/lib.sh
export PYTHONPATH=src
for policy in default cap64; do
  sets=""; [ $policy = cap64 ] && sets="CUDNN_MAX_SHAPES=64 CUDNN_NEW_SHAPES_PER_CALL=None"
  with_module 260 treerl.engine.kernel_plans "$sets" bench/long_trees.py --sections vary --workloads long_prefix \
      --configs auto --repeats 30 --max-seconds 240 --out $OUT/vary_${policy}_s36.json > $OUT/vary_${policy}_s36.log 2>&1
  echo "== $policy ($SECONDS s)"; grep "^vary long_prefix auto:" $OUT/vary_${policy}_s36.log | cut -c1-250
done
python3 - <<'PY'
import json, os
for policy in ("default", "cap64"):
    p = os.path.join(os.environ["OUT"], f"vary_{policy}_s36.json")
    if os.path.exists(p):
        for r in json.load(open(p))["sections"].get("vary", []):
            steps = r.get("steps", [])
            print(policy, "seconds", [round(s["seconds"], 2) for s in steps])
            print(policy, "new shapes", [s["new_kernel_shapes"] for s in steps])
            print(policy, "root split", [any(k.startswith("root:") for k in s["routes"]) for s in steps])
PY
echo "== done ($SECONDS s)"
