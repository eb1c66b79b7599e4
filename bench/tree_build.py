"""PrefixTree.from_sequences on the workloads (issue 24 item 5), CPU.

    PYTHONPATH=src python bench/tree_build.py [--repeats 5] [--out results/tree_build_cpu.json]

Per workload (``treerl.devtools.workloads`` at ``paper`` scale, Qwen3 vocabulary): best of
``--repeats`` seconds to build the tree from numpy arrays, from int64 tensors (what the
learner passes) and from Python lists (what a user passes), and the tree's sizes.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from treerl import PrefixTree
from treerl.devtools.workloads import SCALES, WORKLOADS, make_workload


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workloads", default=",".join(w for w in WORKLOADS if w != "none"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}")
    print("| workload | flat tokens | tree tokens | sequences | arrays ms | tensors ms | lists ms |")
    print("|---|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        arrays = make_workload(name, SCALES["paper"], 151936)
        tensors = [torch.from_numpy(a) for a in arrays]
        lists = [a.tolist() for a in arrays]
        tree = PrefixTree.from_sequences(arrays)
        row = dict(workload=name, flat_tokens=tree.num_flat_tokens, tree_tokens=tree.num_tree_tokens,
                   sequences=tree.num_sequences)
        for kind, seqs in (("arrays", arrays), ("tensors", tensors), ("lists", lists)):
            row[f"{kind}_ms"] = 1e3 * best(lambda: PrefixTree.from_sequences(seqs), args.repeats)
        rows.append(row)
        print(f"| {name} | {row['flat_tokens']} | {row['tree_tokens']} | {row['sequences']} | {row['arrays_ms']:.1f} | "
              f"{row['tensors_ms']:.1f} | {row['lists_ms']:.1f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(cpu=cpu_model(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
