"""Which parts of the tree-aware partitioner earn their lines (issue 16): the imbalance
(slowest rank / mean, predicted by the shipped H200 cost model) and the CPU time of
``partition`` on the benchmark batches, with the piece-assignment algorithms switched on
one at a time. CPU only, ~1 minute:

    PYTHONPATH=src python bench/balance_ablation.py

Batches: ``grpo``, ``agentic``, ``tree`` and ``mixed`` (grpo + agentic + none) of
treerl/workloads.py at scale ``paper``, seeds 0-4, over 2, 4, 8 and 16 ranks, with and
without a per-piece token limit (16,384, the engine budget the cost model was fitted at).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bench_balance import workload_sequences  # noqa: E402

from treerl import PrefixTree  # noqa: E402
from treerl.distributed import partitioner as balance  # noqa: E402
from treerl.models import SHAPES  # noqa: E402


def variants() -> dict[str, dict]:
    """Settings of :func:`balance.assign` per variant (only those this code still has)."""
    out = {"lpt": dict(kk=False, refine=False, exact=0)}
    if hasattr(balance, "_karmarkar_karp"):
        out["lpt+kk"] = dict(kk=True, refine=False, exact=0)
    if hasattr(balance, "_refine"):
        out["lpt+refine"] = dict(kk=False, refine=True, exact=0)
        if hasattr(balance, "_karmarkar_karp"):
            out["lpt+kk+refine"] = dict(kk=True, refine=True, exact=0)
    if hasattr(balance, "_exact"):
        out["all (+exact)"] = dict(kk=True, refine=True, exact=12)
    return out


def run_variant(tree: PrefixTree, k: int, setting: dict, max_rank_tokens: int | None):
    """``partition`` with ``assign`` restricted to ``setting``; (Partition, seconds)."""
    original_assign, original_kk = balance.assign, getattr(balance, "_karmarkar_karp", None)

    names = original_assign.__code__.co_varnames

    def restricted(weights, num_ranks, **kw):
        asked = kw.get("exact_max_pieces", 12)  # partition's own choice (0 inside its split loop)
        kw = {key: v for key, v in kw.items() if key == "node_budget"}
        if "refine" in names:
            kw["refine"] = setting["refine"]
        if "exact_max_pieces" in names:
            kw["exact_max_pieces"] = min(asked, setting["exact"])
        return original_assign(weights, num_ranks, **kw)

    balance.assign = restricted
    if original_kk is not None and not setting["kk"]:
        balance._karmarkar_karp = balance._lpt
    try:
        t0 = time.perf_counter()
        part = balance.partition(tree, k, max_rank_tokens=max_rank_tokens)
        return part, time.perf_counter() - t0
    finally:
        balance.assign = original_assign
        if original_kk is not None:
            balance._karmarkar_karp = original_kk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="grpo,agentic,tree,mixed")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--ranks", default="2,4,8,16")
    p.add_argument("--limits", default="none,16384")
    args = p.parse_args()
    vocab = SHAPES["qwen3-1.7b"]["vocab_size"]
    vs = variants()
    rows = {name: [] for name in vs}
    times = {name: [] for name in vs}
    for workload in args.workloads.split(","):
        for seed in range(args.seeds):
            tree = PrefixTree.from_sequences(workload_sequences(workload, "paper", vocab, seed))
            for k in map(int, args.ranks.split(",")):
                for limit in args.limits.split(","):
                    mrt = None if limit == "none" else int(limit)
                    for name, setting in vs.items():
                        part, s = run_variant(tree, k, setting, mrt)
                        rows[name].append((workload, seed, k, limit, part.imbalance, part.makespan))
                        times[name].append(s)
    base = {(w, s, k, l): m for w, s, k, l, _, m in rows["lpt"]}
    print(f"{'variant':<16}{'batches':>8}{'mean imb.':>10}{'max imb.':>10}{'better than lpt':>16}"
          f"{'mean gain %':>12}{'max gain %':>11}{'ms/call':>9}")
    for name in vs:
        imb = [r[4] for r in rows[name]]
        gains = [100 * (1 - r[5] / base[r[:4]]) for r in rows[name]]
        better = sum(g > 1e-6 for g in gains)
        print(f"{name:<16}{len(imb):>8}{statistics.mean(imb):>10.4f}{max(imb):>10.4f}{better:>16}"
              f"{statistics.mean(gains):>12.3f}{max(gains):>11.3f}{1e3 * statistics.mean(times[name]):>9.1f}")
    print("\nwhat each addition buys (batches where the slowest rank got faster; mean / max %):")
    steps = [("lpt", "lpt+kk"), ("lpt", "lpt+refine"), ("lpt+refine", "lpt+kk+refine"),
             ("lpt+kk+refine", "all (+exact)"), ("lpt+refine", "all (+exact)")]
    for a, b in [(a, b) for a, b in steps if a in vs and b in vs]:
        pairs = [(x[5], y[5]) for x, y in zip(rows[a], rows[b])]
        gains = [100 * (1 - y / x) for x, y in pairs]
        print(f"  {a} -> {b}: {sum(g > 1e-6 for g in gains)} better, {sum(g < -1e-6 for g in gains)} worse, "
              f"mean {statistics.mean(gains):.3f} %, max {max(gains):.3f} %")
    print("\nper workload x ranks (mean imbalance over seeds and limits):")
    keys = sorted({(r[0], r[2]) for r in rows["lpt"]}, key=lambda x: (x[0], x[1]))
    print(f"{'workload':<10}{'ranks':>6}" + "".join(f"{n:>15}" for n in vs))
    for w, k in keys:
        print(f"{w:<10}{k:>6}" + "".join(
            f"{np.mean([r[4] for r in rows[n] if r[0] == w and r[2] == k]):>15.4f}" for n in vs))


if __name__ == "__main__":
    main()
