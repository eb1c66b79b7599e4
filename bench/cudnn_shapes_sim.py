"""CPU simulation of the cuDNN shapes TreeEngine meets on CUDA when every step's trees are new.

    cd /work/main && PYTHONPATH=src .venv/bin/python bench/cudnn_shapes_sim.py --steps 300 \
        --out bench/results/cudnn_shapes_sim_s35.json

What is real here (the repository's code, unmodified): the workloads and per-step variation of
bench/long_trees.py::vary (seed = 1 + step, the long_prefix prompt jitter from rng 1000 + step),
the Qwen3-1.7B model shape (built on the meta device: no weights), TreeEngine's planner at an
H100's default budget (25% of 85,029,158,912 bytes = 19.80 GiB) with the attention backend
"flex", and kernel_plans.planned / plans_room / engine_call / SHAPES with a fake "cudnn" Kernel
(align 128) and a fake "flash" fallback (align 1), called with meta tensors of the shapes that
the engine's attention would pass.

What is replicated (not imported, because it needs CUDA or real compute): the memory model that
the engine measures on CUDA (the test suite's h100_like(): 2.56 MB/token held, 0.40 MB/token
recomputed, the analytic fixed bytes; the CPU estimate differs), the order of the engine's model
calls under a separable loss (TreeEngine.forward_backward -> _forward_backward_segments, then
one_pass/_grad_pass), and per call the route decisions of TreeEngine._call / _split_trees /
TreeAttention / attention._attend on a CUDA device in bf16 with flex.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from treerl import PrefixTree, TreeEngine
from treerl.devtools.workloads import SCALES, make_workload
from treerl.engine import attention as attn
from treerl.engine import chain_attention as chain
from treerl.engine import kernel_plans as plans
from treerl.engine.memory import MemoryModel, attention_heads, attention_held, keys_values, weight_gradient_transients
from treerl.engine.rooted_trees import rooted_trees
from treerl.models import build_model

H100_TOTAL = 85_029_158_912  # an H100 80GB's total_memory (tests/engine/test_engine_memory.py)
CUDNN = chain.Kernel("cudnn", None, None, align=chain.ALIGN["cudnn"])
FLASH = chain.Kernel("flash", None, None, align=1)
META = torch.device("meta")
DTYPE = torch.bfloat16

POLICIES = {  # name -> (CUDNN_NEW_SHAPES_PER_CALL, CUDNN_MAX_SHAPES)
    "unbounded": (None, None),  # every shape planned: the novelty of the shapes themselves
    "cap64": (None, 64),  # the old policy: 64 a process, then flash (chains/groups) or the mask (root split)
    "call8": (8, None),  # the per-call allowance alone
    # the code's; session 35's stored run (results/cudnn_shapes_sim_s35.json) named it "call8+cap1024" (8, 1,024 then)
    "defaults": (plans.CUDNN_NEW_SHAPES_PER_CALL, plans.CUDNN_MAX_SHAPES),
}


def h100_model(config) -> MemoryModel:
    """tests/engine/test_engine_memory.py::h100_like: the H100-measured model of the Qwen3-1.7B shape."""
    return MemoryModel(fixed=3 * (1 << 27) * 4 + weight_gradient_transients(config, 2), per_token=2.56e6,
                       recompute_per_token=0.40e6, measured=True, **attention_held(config, DTYPE, False),
                       **keys_values(config, DTYPE))


def build_engine(budget: int, fixed: float | None = None) -> TreeEngine:
    model = build_model("qwen3", "qwen3-1.7b", dtype=DTYPE, device="meta")
    engine = TreeEngine(model, compile=False, memory_budget=budget)
    engine.attention = "flex"  # as on CUDA ("auto" -> flex); the planner reads memory.attention
    engine.memory.attention = "flex"
    engine.memory._model = h100_model(model.config)
    if fixed is not None:  # sensitivity: the measured model's fixed bytes differ a little from the analytic ones
        engine.memory._model = dataclasses.replace(engine.memory._model, fixed=fixed)
    return engine


def tree_for(wl: str, step: int, vocab: int) -> PrefixTree:
    """bench/long_trees.py::vary's tree of step ``step``."""
    spec = SCALES["paper"]
    rng = np.random.default_rng(1000 + step)
    jitter = int(rng.integers(-spec.long_prefix_len_one // 16, spec.long_prefix_len_one // 16 + 1))
    shaped = dataclasses.replace(spec, long_prefix_len_one=spec.long_prefix_len_one + jitter)
    return PrefixTree.from_sequences(make_workload(wl, shaped, vocab, seed=1 + step))


class Step:
    """One engine forward_backward: its model calls' fused-kernel parts, through plans.planned."""

    def __init__(self, engine: TreeEngine, tree: PrefixTree):
        self.engine, self.tree = engine, tree
        self.plan = engine.plan(tree)
        self.heads = attention_heads(engine.model.config)
        self.ends = tree.subtree_end
        self.parts: list[dict] = []  # per fused part of a model call: shape key, kernel, work
        self.routes = collections.Counter()  # per model call (x layers on the device)

    def q_k(self, n: int, prefix: int):
        h, hk, d = self.heads
        return (torch.empty(1, h, n, d, device=META, dtype=DTYPE), torch.empty(1, hk, prefix + n, d, device=META, dtype=DTYPE))

    def fused(self, n: int, prefix: int, causal: bool, what: str) -> str:
        """chain.kernel_for's planned() for q [n] after k [prefix + n]; returns the kernel's name."""
        q, k = self.q_k(n, prefix)
        key = plans._shape(CUDNN, META, DTYPE, *self.heads, n, prefix, causal)
        if not causal and key[-3 + 1] == 0:  # (rows, full_keys, causal): full_keys 0
            return "mask:short-prefix"
        seen_before = key in plans.SHAPES.get(CUDNN.label, set())
        kernel = plans.planned(CUDNN, q, k, lambda: FLASH, causal)
        layout = plans.Layout.of(n, prefix, CUDNN.align, causal)
        # attention work of the part(s) on the grid: full part rows x full keys, causal part rows^2/2
        work = layout.rows * layout.full_keys + (layout.rows * layout.rows / 2 if causal else 0)
        self.parts.append(dict(key=key[5:], kernel=kernel.name, what=what, seen=seen_before, work=work))
        return kernel.name

    def call(self, i: int) -> None:
        """TreeEngine._call's attention route for segment i (CUDA, bf16, flex), the fused parts planned."""
        plan, seg = self.plan, self.plan.segments[i]
        ancestors = plan.ancestors(i)
        prefix = sum(plan.segments[a].size for a in ancestors)
        spans = [plan.segments[a] for a in ancestors] + [seg]
        is_chain = all(int(self.ends[s.start:s.end].min()) >= seg.end for s in spans)
        if prefix and is_chain:
            self.routes["chain:" + self.fused(seg.size, prefix, True, "chain")] += 1
        elif prefix:  # a group (GROUPS_AFTER_PREFIX on CUDA; every query sees the prefix)
            self.routes["group:" + self.fused(seg.size, prefix, False, "group")] += 1
        elif is_chain:
            self.routes["causal"] += 1  # SDPA's own causal kernel, not chain_attention's
        else:
            self.routes[self.root_split(seg)] += 1

    def root_split(self, seg) -> str:
        roots = rooted_trees(self.ends[seg.start:seg.end], seg.start)
        # TreeAttention._splits on CUDA (flex backend)
        starts = [0] + [t.end for t in roots[:-1]]
        splits = (0 < len(roots) <= attn.ROOT_SPLIT_MAX_TREES and [t.start for t in roots] == starts
                  and roots[-1].end == seg.size and any(t.rest for t in roots)
                  and all(t.root >= max(attn.ROOT_SPLIT_MIN_TOKENS, 1) for t in roots))
        if not splits:
            return "mask"
        # TreeEngine._split_trees: every part planned or within the allowance, else the tree mask
        parts = [(t.root, 0, True) for t in roots] + [(t.rest, t.root, False) for t in roots if t.rest]
        if not plans.plans_room(CUDNN, META, DTYPE, *self.heads, parts):
            for t in roots:  # recorded as parts that took the mask (for the share of calls on cuDNN)
                for n, p, c in ((t.root, 0, True), (t.rest, t.root, False)):
                    if n:
                        key = plans._shape(CUDNN, META, DTYPE, *self.heads, n, p, c)
                        layout = plans.Layout.of(n, p, CUDNN.align, c)
                        self.parts.append(dict(key=key[5:], kernel="mask", what="root", work=layout.rows * layout.full_keys
                                               + (layout.rows ** 2 / 2 if c else 0),
                                               seen=key in plans.SHAPES.get(CUDNN.label, set())))
            return "mask:root-no-room"
        labels = []
        for t in roots:
            labels.append(self.fused(t.root, 0, True, "root"))
            if t.rest:
                labels.append(self.fused(t.rest, t.root, False, "root"))
        return "root:" + "+".join(dict.fromkeys(labels))

    def run(self) -> "Step":
        """TreeEngine.forward_backward(separable=True): its model calls in order, as one engine call."""
        with plans.engine_call():
            return self._calls()

    def _calls(self) -> "Step":
        plan = self.plan
        n = len(plan.segments)
        if plan.single_level:
            for i in range(n):
                self.call(i)
            return self
        chained = plan.chained_segments()
        for i in range(n):  # _forward_backward_segments(skip=chained)
            if i not in chained:
                self.call(i)
        path: list[int] = []  # one_pass -> _grad_pass(only=chained, losses=...)

        def close(i: int) -> None:
            if not plan.segments[i].retain:
                self.call(i)  # the recompute with grad (a retained chain's graph is held: no call)

        for i, seg in enumerate(plan.segments):
            if i not in chained:
                continue
            while path and path[-1] != seg.parent:
                close(path.pop())
            if plan.children[i]:
                self.call(i)  # with grad (retained) or without (its recompute comes at close)
                path.append(i)
            elif len(plan.targets[i]):
                self.call(i)
        while path:
            close(path.pop())
        return self


def simulate(engine: TreeEngine, trees: list[PrefixTree], policy: str) -> dict:
    """``trees`` one step each under ``policy``, from no planned shape; chain_attention's bounds and shape
    records are the caller's again afterwards."""
    kept = plans.CUDNN_NEW_SHAPES_PER_CALL, plans.CUDNN_MAX_SHAPES, plans.SHAPES
    plans.CUDNN_NEW_SHAPES_PER_CALL, plans.CUDNN_MAX_SHAPES = POLICIES[policy]
    plans.SHAPES = {}
    try:
        return _simulate(engine, trees, policy)
    finally:
        plans.CUDNN_NEW_SHAPES_PER_CALL, plans.CUDNN_MAX_SHAPES, plans.SHAPES = kept


def _simulate(engine: TreeEngine, trees: list[PrefixTree], policy: str) -> dict:
    earlier: set = set()  # shapes met (by any kernel) in earlier steps
    rows = []
    for tree in trees:
        before = len(plans.SHAPES.get("cudnn", set()))
        step = Step(engine, tree).run()
        parts = step.parts
        met = {p["key"] for p in parts}
        total_work = sum(p["work"] for p in parts) or 1.0
        rows.append(dict(
            tree_tokens=tree.num_tree_tokens, calls=len(parts), plan=step.plan.describe(),
            routes=dict(step.routes),
            new_shapes=len(met - earlier),  # distinct shapes of this step not met in any earlier step
            plans=len(plans.SHAPES.get("cudnn", set())) - before,  # cuDNN plans built this step
            cudnn_calls=sum(p["kernel"] == "cudnn" for p in parts),
            flash_calls=sum(p["kernel"] == "flash" for p in parts),
            mask_calls=sum(p["kernel"] == "mask" for p in parts),
            calls_seen_earlier=sum(p["key"] in earlier for p in parts),  # shape met in an earlier step
            cudnn_work=sum(p["work"] for p in parts if p["kernel"] == "cudnn") / total_work,
            distinct=len(earlier | met),
        ))
        earlier |= met
    return dict(policy=policy, steps=rows, distinct_shapes=len(earlier),
                cudnn_shapes=len(plans.SHAPES.get("cudnn", set())))


def summary(res: dict, windows=((0, 1), (1, 5), (5, 20), (20, 100), (100, 300))) -> dict:
    steps = res["steps"]
    out = {}
    for a, b in windows:
        s = steps[a:b]
        if not s:
            continue
        calls = max(1, sum(r["calls"] for r in s))
        out[f"{a}-{b - 1}"] = dict(
            new_per_step=round(np.mean([r["new_shapes"] for r in s]), 2),
            plans_per_step=round(np.mean([r["plans"] for r in s]), 2),
            max_plans=max(r["plans"] for r in s),
            calls_per_step=round(sum(r["calls"] for r in s) / len(s), 1),
            split_steps=sum(r["routes"].get("chain:cudnn", 0) + r["routes"].get("chain:flash", 0) > 0 for r in s),
            seen_earlier=round(sum(r["calls_seen_earlier"] for r in s) / calls, 3),
            on_cudnn=round(sum(r["cudnn_calls"] for r in s) / calls, 3),
            cudnn_work=round(float(np.mean([r["cudnn_work"] for r in s])), 3),
            distinct_end=s[-1]["distinct"])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="grpo,agentic,long,tree,long_prefix,episodes")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--budget", type=float, default=0.25 * H100_TOTAL, help="bytes (default: an H100's 25%%)")
    ap.add_argument("--fixed", type=float, default=None, help="the memory model's fixed bytes (sensitivity)")
    ap.add_argument("--out", default="bench/results/cudnn_shapes_sim.json")
    args = ap.parse_args(argv)
    engine = build_engine(int(args.budget), args.fixed)
    vocab = engine.model.config.vocab_size
    results = dict(args=vars(args), budget_gib=engine.memory.budget / 2**30, max_tokens=engine.memory.max_tokens,
                   pack_tokens=engine.memory.pack_tokens, workloads={})
    print(f"budget {results['budget_gib']:.2f} GiB, {results['max_tokens']} tokens a call, pack {results['pack_tokens']}")
    for wl in args.workloads.split(","):
        t = time.time()
        trees = [tree_for(wl, step, vocab) for step in range(args.steps)]
        res = {}
        for policy in args.policies.split(","):
            r = simulate(engine, trees, policy)
            r["summary"] = summary(r)
            res[policy] = r
        results["workloads"][wl] = res
        u = res[args.policies.split(",")[0]]
        print(f"\n== {wl} ({time.time() - t:.0f} s): step 0 plan {u['steps'][0]['plan']}; routes {u['steps'][0]['routes']}")
        print("  first 10 steps, new shapes (unbounded):", [r["new_shapes"] for r in u["steps"][:10]])
        for policy, r in res.items():
            print(f"  {policy:14s} distinct {r['distinct_shapes']:4d}  cudnn plans {r['cudnn_shapes']:4d}")
            for window, row in r["summary"].items():
                print(f"     steps {window:8s} {json.dumps(row)}")
        Path(args.out).write_text(json.dumps(results, default=str))
    if {"unbounded", "call8", "cap64"} <= set(args.policies.split(",")):
        by_step_kind(results)
    return results


def by_step_kind(d: dict) -> None:
    """long_prefix's and episodes' steps apart by kind (one call / split into chains), per window: new shapes a step
    (unbounded), the share of calls and of attention work on cuDNN and the plans a step under call8 and cap64."""
    for wl in ("long_prefix", "episodes"):
        if wl not in d["workloads"]:
            continue
        r = d["workloads"][wl]
        u, c, o = (r[p]["steps"] for p in ("unbounded", "call8", "cap64"))
        split = [any(k.startswith("chain") for k in x["routes"]) for x in u]
        print(f"== {wl}: {sum(split)} of {len(u)} steps split into chains")
        for lo, hi in ((0, 20), (20, 100), (100, 300)):
            for kind, want in (("one-call", False), ("split", True)):
                idx = [i for i in range(lo, min(hi, len(u))) if split[i] == want]
                if not idx:
                    continue

                def share(steps):
                    return sum(steps[i]["cudnn_calls"] for i in idx) / max(1, sum(steps[i]["calls"] for i in idx))

                def work(steps):
                    return float(np.mean([steps[i]["cudnn_work"] for i in idx]))

                new = [u[i]["new_shapes"] for i in idx]
                print(f"  steps {lo}-{hi - 1} {kind:8s} n={len(idx):3d} new/step {np.mean(new):.2f} "
                      f"hist {dict(sorted(collections.Counter(new).items()))} "
                      f"calls/step {np.mean([u[i]['calls'] for i in idx]):.1f} | on cuDNN: call8 {share(c):.3f} "
                      f"(work {work(c):.3f}) plans/step {np.mean([c[i]['plans'] for i in idx]):.2f} "
                      f"max {max(c[i]['plans'] for i in idx)}; cap64 {share(o):.3f} (work {work(o):.3f}) "
                      f"plans/step {np.mean([o[i]['plans'] for i in idx]):.2f}")
        full = next((i for i, x in enumerate(o) if sum(y["plans"] for y in o[:i + 1]) >= 64), None)
        print(f"  cap64 reached at step {full}; distinct after 20/50/100/200/300 steps:",
              [u[min(n, len(u)) - 1]["distinct"] for n in (20, 50, 100, 200, 300)])


if __name__ == "__main__":
    main()
