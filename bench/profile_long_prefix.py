"""Where long_prefix's step goes (issue 24): one forward_backward of the 32k-token shared prefix workload
(Qwen3-1.7B shape, bf16, ``TreeEngine`` defaults) under the torch profiler, with the chain attention after a
prefix off (the default) and on; per setting the wall time, GPU busy time by kernel kind and the top kernels.

    PYTHONPATH=src python bench/profile_long_prefix.py --out bench/results/      # H100, ~2 min
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from profile_engine import profile_step
from treerl import PrefixTree, TreeEngine
from treerl.devtools.benchmark import weighted_logprob_loss
from treerl.devtools.workloads import SCALES, make_workload
from treerl.engine import attention
from treerl.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="long_prefix")
    ap.add_argument("--out", default=None)
    ap.add_argument("--chain", default="off,on", help="the chain attention after a prefix: off, on or both")
    args = ap.parse_args()
    out = Path(args.out) if args.out else None
    model = build_model("qwen3", "qwen3-1.7b", dtype=torch.bfloat16, device="cuda", seed=0)
    model.train()
    tree = PrefixTree.from_sequences(make_workload(args.workload, SCALES["paper"], model.config.vocab_size))
    loss = weighted_logprob_loss(tree)
    rows = {}
    for chain in [c == "on" for c in args.chain.split(",")]:
        attention.CHAIN_AFTER_PREFIX = chain
        engine = TreeEngine(model)
        t0 = time.perf_counter()
        engine.forward_backward(tree, loss, separable=True)  # warm-up (compile, probe)
        print(f"warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        label = f"{args.workload}:{'chain' if chain else 'mask'}"
        rows[label] = profile_step(engine, tree, loss, out, label)
        rows[label]["routes"] = dict(engine.stats.attention) if hasattr(engine, "stats") else None
        print(label, json.dumps(rows[label]), flush=True)
        if out is not None:
            print((out / f"kernels_{label.replace(':', '_')}.txt").read_text()[:6000], flush=True)
    if out is not None:
        (out / f"profile_{args.workload}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
