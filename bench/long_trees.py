"""Long trees (issue 24) in one run: memory model against measured peaks, the long shapes'
speed, and tree attention against the best causal kernels.

    python bench/long_trees.py --out results/long_trees_h100.json          # H100, ~6-7 min
    python bench/long_trees.py --smoke --out /tmp/long_trees_smoke.json    # CPU, tiny sizes
    python bench/long_trees.py --sections workloads --workloads grpo,agentic,long,tree \
        --configs auto,auto-general --repeats 3 --out bench/results/general_path_h100.json   # item 3, ~4-5 min

Sections, each written to ``--out`` as soon as it is measured (run in the order peak, sweep,
attention, workloads; a section is skipped once ``--max-seconds`` have passed):

1. **peak**: the warm bf16 matmul peak (``bench/profile_engine.py``'s), for % of peak.
   ``first_step_s``: the process's first ``forward_backward`` (the sweep's 4k tree), compilation
   included (torch's FX graph and AOTAutograd caches are on by default: a second process on
   the same machine reads them).
2. **sweep**: the memory model's peak (``Plan.peak_bytes``: before kept attentions, which
   take what the budget leaves beside a recomputed call) and the budget, against the measured
   peak of activations (``max_memory_allocated`` above weights and gradients) for trees shaped
   like the 32k-token prefix (``workloads.memory_sweep_tree``) of 4k..64k tokens, at defaults.
3. **workloads**: ``long_prefix`` and ``episodes`` (``treerl.devtools.workloads``) through ``auto``
   and ``dfs`` at defaults, plus A/B variants: ``auto-general`` (the same loss not declared
   separable: the general path, printed as a ratio to ``auto``), ``auto-noreuse`` (phase 2 recomputes the K/V
   of phase 1's last path, as before), ``auto-tiles`` / ``dfs-tiles`` (calls after a prefix
   on whole flex tiles, ``treerl.engine.attention.PREFIX_AS_TILES``), ``auto-b0.3`` (a 30% budget),
   ``auto-off`` / ``dfs-off`` (calls after a prefix with the tree mask: ``CHAIN_AFTER_PREFIX`` and
   ``GROUPS_AFTER_PREFIX`` off; the defaults run them through the fused kernels on CUDA: chain pieces by
   ``treerl.engine.chain_attention``, groups of leaves such as long_prefix's responses by
   ``treerl.engine.group_attention``), ``auto-chain`` / ``auto-group`` (one of the two paths only),
   ``auto-flash`` (both through flash's kernels only, not cuDNN's), ``auto-root`` (the root split,
   ``treerl.engine.attention.ROOT_SPLIT``: a call without prefix that starts with a long root chain, such
   as long_prefix's whole tree in one call, runs that chain through the probed fused kernel and the rest as
   a group after it, instead of the tree mask over the whole call; on for CUDA by default, forced on here),
   ``auto-noroot`` (the root split off: the tree mask over such a call), ``auto-roots`` (the root split
   forced on for calls of up to 8 trees, ``ROOT_SPLIT_MAX_TREES``: e.g. the workload ``long``'s two trees
   in one call, which the default of one tree leaves to the tree mask).
   Per row: seconds, unique-token TFLOP/s and % of peak (DESIGN.md's formula), peak GiB (total and above
   weights and gradients), the modelled peak, calls, the plan, and the timed step's attention layer calls
   by route (``attention``: ``causal``, ``chain:<kernel>``, ``group:<kernel>``, ``mask``, ``mask:chain-off``,
   ``mask:no-kernel``, ``mask:short-prefix``, ``mask:group-sdpa``, ``root:<kernel>``, ``kept``;
   ``treerl.engine.attention.ROUTES``), with ``chain_shapes``
   (distinct chain- and group-attention kernel shapes so far per kernel: cuDNN builds a plan per shape) and
   the kernel probe's verdicts.
4. **attention**: one layer's attention forward+backward (Qwen3-1.7B heads: 16 query / 8 KV
   of 128, bf16) on one causal sequence of 8k/16k/32k tokens: the engine's tree attention
   (flex on whole tiles with the tree block mask, ``treerl.engine.attention.flex_tree_attention``)
   against SDPA's causal cuDNN and flash kernels; and a chain piece after a long prefix
   (2,048 queries after 30,720 keys: the engine's prefix call) through flex (as the engine
   calls it, and on whole tiles: ``PREFIX_AS_TILES``) against SDPA flash with the causal mask
   aligned bottom-right. Each kernel's output and gradients are compared with the first's
   (``max_diff_vs_first``: bf16 rounding is ~1e-2, a wrong mask O(1)). TFLOP/s on visible
   pairs x 12 x heads x head_dim (DESIGN.md's forward+backward count). On CUDA also long_prefix's
   tree in one call (the tree mask, and the engine's route: the root split) beside SDPA's causal
   kernels on one sequence of its length (issue 24 item 2).
5. **vary** (not in the default sections): each ``--workloads`` x ``--configs`` with a new tree
   every step, as in an RL run (long_prefix's prompt 30,000-34,000 tokens), ``--repeats`` steps
   after one: per step the seconds, % of peak and the kernel shapes new to the process (cuDNN
   builds a plan for each, ~0.1-0.3 s), e.g. ``--sections vary --workloads long_prefix
   --configs auto-noroot,auto --repeats 6``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before torch touches CUDA

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_engine import matmul_peak  # noqa: E402

from treerl import PrefixTree, TreeEngine  # noqa: E402
from treerl.devtools.benchmark import time_forward_backward, useful_flops, weighted_logprob_loss  # noqa: E402
from treerl.models import build_model  # noqa: E402
from treerl.devtools.workloads import SCALES, make_workload, memory_sweep_tree  # noqa: E402

VARIANTS = {  # name -> (engine kwargs, engine attributes set on the instance, treerl.engine.attention switches)
    "auto": (dict(mode="auto"), {}, {}),
    "dfs": (dict(mode="dfs"), {}, {}),
    "auto-noreuse": (dict(mode="auto"), dict(reuse_forward_kv=False), {}),
    "auto-tiles": (dict(mode="auto"), {}, dict(PREFIX_AS_TILES=True)),
    "dfs-tiles": (dict(mode="dfs"), {}, dict(PREFIX_AS_TILES=True)),
    "auto-b0.2": (dict(mode="auto", memory_budget=0.2), {}, {}),
    "auto-b0.3": (dict(mode="auto", memory_budget=0.3), {}, {}),
    "auto-b0.45": (dict(mode="auto", memory_budget=0.45), {}, {}),
    # calls after a prefix (issue 24): the defaults run chain pieces (treerl.engine.chain_attention) and
    # groups of leaves (treerl.engine.group_attention) through the fused kernels on CUDA; the A/B variants
    "auto-off": (dict(mode="auto"), {}, dict(CHAIN_AFTER_PREFIX=False, GROUPS_AFTER_PREFIX=False)),  # the tree mask
    "dfs-off": (dict(mode="dfs"), {}, dict(CHAIN_AFTER_PREFIX=False, GROUPS_AFTER_PREFIX=False)),
    "auto-chain": (dict(mode="auto"), {}, dict(CHAIN_AFTER_PREFIX=True, GROUPS_AFTER_PREFIX=False)),  # chains only
    "auto-group": (dict(mode="auto"), {}, dict(CHAIN_AFTER_PREFIX=False, GROUPS_AFTER_PREFIX=True)),  # groups only
    # both through flash's kernels only (cuDNN builds a plan per new shape)
    "auto-flash": (dict(mode="auto"), {}, {"chain_attention.KERNELS": ("flash",)}),
    # a call without prefix that starts with a long root chain: the root split (on for CUDA by default)
    "auto-root": (dict(mode="auto"), {}, dict(ROOT_SPLIT=True)),
    "auto-noroot": (dict(mode="auto"), {}, dict(ROOT_SPLIT=False)),
    "auto-roots": (dict(mode="auto"), {}, dict(ROOT_SPLIT=True, ROOT_SPLIT_MAX_TREES=8)),  # calls of several trees
    "auto-general": (dict(mode="auto"), {}, {}),  # the same loss, not declared separable (issue 24 item 3)
    # every recomputed layer keeps its attention whatever the memory model says (what the model's margin costs)
    "auto-keepall": (dict(mode="auto"), {"memory.kept_attention_layers": "all"}, {}),
}
GENERAL = {"auto-general"}  # variants timed with separable=False


@contextlib.contextmanager
def switches(name: str):
    """The variant's switches for the duration of its rows: attributes of ``treerl.engine.attention``,
    or ``module.NAME`` of another ``treerl.engine`` module."""
    import importlib

    def where(key):
        module, _, attr = key.rpartition(".")
        return importlib.import_module(f"treerl.engine.{module or 'attention'}"), attr

    before = {key: getattr(*where(key)) for key in VARIANTS[name][2]}
    for key, value in VARIANTS[name][2].items():
        setattr(*where(key), value)
    try:
        yield
    finally:
        for key, value in before.items():
            setattr(*where(key), value)


class Run:
    def __init__(self, args):
        self.args = args
        self.t0 = time.perf_counter()
        self.out = Path(args.out) if args.out else None
        self.results: dict = dict(args=vars(args), torch=torch.__version__, sections={})

    def over(self) -> bool:
        return time.perf_counter() - self.t0 > self.args.max_seconds

    def save(self) -> None:
        if self.out:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(self.results, indent=1))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_engine(model, name: str, smoke_budget: int | None) -> TreeEngine:
    kwargs, attrs, _ = VARIANTS[name]
    kwargs = dict(kwargs)
    if smoke_budget is not None and "memory_budget" not in kwargs:
        kwargs["memory_budget"] = smoke_budget
    engine = TreeEngine(model, **kwargs)
    for key, value in attrs.items():
        if key == "memory.kept_attention_layers" and value == "all":
            every = frozenset(range(engine.memory.layers))
            engine.memory.kept_attention_layers = lambda *args, **kwargs: every
        else:
            setattr(engine, key, value)
    return engine


def sweep(run: Run, model, device, smoke_budget) -> list[dict]:
    rows = []
    engine = make_engine(model, "auto", smoke_budget)
    engine.memory.model  # the probe's allocations are not a step's
    sizes = [64, 128, 256] if run.args.smoke else [4096, 16384, 32768, 65536]
    for tokens in sizes:
        if run.over():
            break
        tree = PrefixTree.from_sequences(memory_sweep_tree(tokens, model.config.vocab_size))
        row = dict(tokens=tokens, longest=int(tree.seq_lengths.max()), budget_gib=engine.memory.budget / 2**30)
        try:
            plan = engine.plan(tree)
            row.update(predicted_gib=plan.peak_bytes / 2**30, plan=plan.describe())
            loss = weighted_logprob_loss(tree)
            t = time.perf_counter()
            engine.forward_backward(tree, loss, separable=True)  # warm: compile for new lengths
            sync(device)
            row["first_seconds"] = time.perf_counter() - t  # the process's first step: compilation
            run.results.setdefault("first_step_s", row["first_seconds"])
            if device.type == "cuda":
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            engine.forward_backward(tree, loss, separable=True)
            sync(device)
            row["seconds"] = time.perf_counter() - t
            if device.type == "cuda":
                row["measured_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
                row["reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        except Exception as exc:  # a result (a refusal names what the path needs), not a crash
            failed(row, exc, device)
        model.zero_grad(set_to_none=False)
        rows.append(row)
        print("sweep", json.dumps(row), flush=True)
        run.results["sections"]["sweep"] = rows
        run.save()
    return rows


def alloc_retries(device) -> int:
    """The caching allocator's count of allocations that failed, freed its cache and tried again."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def failed(row: dict, exc: Exception, device) -> None:
    """``row`` records ``exc`` (printed with its traceback); the allocator's cache freed after it."""
    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    traceback.print_exc()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def workloads(run: Run, model, device, peak, smoke_budget) -> list[dict]:
    rows = []
    scale = "small" if run.args.smoke else "paper"
    for wl in run.args.workloads.split(","):
        tree = PrefixTree.from_sequences(make_workload(wl, SCALES[scale], model.config.vocab_size))
        loss = weighted_logprob_loss(tree)
        flops = useful_flops(model, tree)
        print(f"\n{wl}: {tree.num_sequences} seqs, {tree.num_flat_tokens} flat / {tree.num_tree_tokens} tree tokens, "
              f"longest {int(tree.seq_lengths.max())}, ideal {tree.ideal_ratio:.2f}", flush=True)
        for name in run.args.configs.split(","):
            if run.over():
                break
            row = dict(workload=wl, config=name, tree_tokens=tree.num_tree_tokens, flat_tokens=tree.num_flat_tokens)
            try:
                engine = make_engine(model, name, smoke_budget)
                engine.memory.model
                sync(device)
                base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                retries = alloc_retries(device)
                with switches(name):
                    seconds, times, peak_bytes = time_forward_backward(engine, tree, loss, run.args.repeats, 1,
                                                                       separable=name not in GENERAL)
                    plan = engine.plan(tree)
                from treerl.engine import kernel_plans as plans

                row.update(attention=dict(sorted(engine.stats.attention.items())),
                           chain_shapes={k: len(v) for k, v in plans.SHAPES.items()})
                row.update(seconds=seconds, times=times, tflops=flops / seconds / 1e12, calls=engine.stats.model_calls,
                           recomputed_calls=engine.stats.recomputed_calls, kept_graphs=engine.stats.kept_graphs,
                           tokens_run=engine.stats.tokens_run,
                           kept_attention_layers=engine.stats.kept_attention_layers, plan=plan.describe(),
                           predicted_gib=plan.peak_bytes / 2**30, budget_gib=engine.memory.budget / 2**30)
                if device.type == "cuda":  # the allocator freeing its cache to retry (a sync each): slow steps
                    row["alloc_retries"] = alloc_retries(device) - retries  # (warm-up and timed steps)
                if peak:
                    row["pct_peak"] = 100 * row["tflops"] / peak
                if peak_bytes is not None:
                    row.update(peak_gib=peak_bytes / 2**30, activation_gib=(peak_bytes - base) / 2**30)
            except Exception as exc:  # an out-of-memory or a refusal is a result
                failed(row, exc, device)
            model.zero_grad(set_to_none=False)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "times"}), flush=True)
            if "attention" in row:
                from treerl.engine import chain_attention as chain

                print(f"  attention layer calls by route ({wl}, {name}, the timed step): {row['attention']}; "
                      f"chain kernel shapes so far: {row['chain_shapes']}; probe: {chain.PROBED}", flush=True)
                run.results["chain_probe"] = chain.PROBED
            run.results["sections"]["workloads"] = rows
            run.save()
    return rows


def vary(run: Run, model, device, peak, smoke_budget) -> list[dict]:
    """Each workload with a new tree every step, as an RL run's (``make_workload``'s seed 1, 2, ...;
    long_prefix's prompt also 30,000-34,000 tokens at paper scale): per step its seconds, % of peak
    and the new shapes the fused kernels saw (cuDNN builds a plan for each), per config."""
    import dataclasses

    import numpy as np

    from treerl.engine import kernel_plans as plans

    rows = []
    spec = SCALES["small" if run.args.smoke else "paper"]
    for wl in run.args.workloads.split(","):
        for name in run.args.configs.split(","):
            if run.over():
                break
            row = dict(workload=wl, config=name, steps=[])
            try:
                engine = make_engine(model, name, smoke_budget)
                engine.memory.model
                with switches(name):
                    for step in range(run.args.repeats + 1):  # the first: the config's warm-up on a new tree
                        rng = np.random.default_rng(1000 + step)
                        jitter = int(rng.integers(-spec.long_prefix_len_one // 16, spec.long_prefix_len_one // 16 + 1))
                        shaped = dataclasses.replace(spec, long_prefix_len_one=spec.long_prefix_len_one + jitter)
                        tree = PrefixTree.from_sequences(make_workload(wl, shaped, model.config.vocab_size, seed=1 + step))
                        loss = weighted_logprob_loss(tree)
                        shapes = sum(map(len, plans.SHAPES.values()))
                        sync(device)
                        t0 = time.perf_counter()
                        engine.forward_backward(tree, loss, separable=name not in GENERAL)
                        sync(device)
                        seconds = time.perf_counter() - t0
                        model.zero_grad(set_to_none=False)
                        flops = useful_flops(model, tree)
                        row["steps"].append(dict(
                            tree_tokens=tree.num_tree_tokens, seconds=seconds,
                            pct_peak=100 * flops / seconds / 1e12 / peak if peak else None,
                            new_kernel_shapes=sum(map(len, plans.SHAPES.values())) - shapes,
                            routes=dict(sorted(engine.stats.attention.items()))))
                        print(f"vary {wl} {name} step {step}: {json.dumps(row['steps'][-1])}", flush=True)
                timed = [s["seconds"] for s in row["steps"][1:]]
                if timed:
                    row.update(median_s=float(np.median(timed)), mean_s=float(np.mean(timed)))
            except Exception as exc:  # an out-of-memory or a refusal is a result
                failed(row, exc, device)
            model.zero_grad(set_to_none=False)
            rows.append(row)
            run.results["sections"]["vary"] = rows
            run.save()
    return rows


def attention(run: Run, device, dtype) -> list[dict]:
    """One layer's attention forward+backward: the engine's tree attention against SDPA."""
    from torch.nn.attention.bias import causal_lower_right

    from treerl.engine.attention import flex_block_mask, flex_tree_attention

    heads, kv_heads, dim = 16, 8, 128
    rows = []
    repeats = 1 if run.args.smoke else 5
    lengths = [128] if run.args.smoke else [8192, 16384, 32768]
    prefix_shape = (64, 128) if run.args.smoke else (2048, 30720)  # (queries, prefix keys)

    def timed(fn) -> float:
        fn()
        sync(device)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - t)
        return best

    def measure(label, nq, nk, pairs, kernels):
        gen = torch.Generator(device="cpu").manual_seed(nq + nk)
        q = torch.randn(1, heads, nq, dim, generator=gen, dtype=dtype).to(device).requires_grad_()
        k = torch.randn(1, kv_heads, nk, dim, generator=gen, dtype=dtype).to(device).requires_grad_()
        v = torch.randn(1, kv_heads, nk, dim, generator=gen, dtype=dtype).to(device).requires_grad_()
        grad = torch.randn(1, heads, nq, dim, generator=gen, dtype=dtype).to(device)
        first = None  # the first kernel's output and gradients: the others' differences from it
        for name, fwd in kernels.items():
            if run.over():
                return
            row = dict(shape=label, queries=nq, keys=nk, kernel=name)
            try:
                def step():
                    out = fwd(q, k, v)
                    return (out, *torch.autograd.grad(out, (q, k, v), grad))
                seconds = timed(step)
                row.update(ms=1e3 * seconds, tflops=pairs * 12 * heads * dim / seconds / 1e12)
                got = [x.detach().float() for x in step()]
                if first is None:
                    first = got
                else:  # bf16 kernels differ by rounding; a wrong mask differs by O(1)
                    row["max_diff_vs_first"] = max(float((a - b).abs().max()) for a, b in zip(got, first))
            except Exception as exc:  # a kernel this device/torch lacks is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            print("attention", json.dumps(row), flush=True)
            run.results["sections"]["attention"] = rows
            run.save()

    def sdpa(backend, expand=False, bias=None):
        def fwd(q, k, v):
            if expand:
                k, v = (x.repeat_interleave(heads // kv_heads, 1) for x in (k, v))
            with sdpa_kernel([backend]):
                if bias is not None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=not expand)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not expand)
        return fwd

    def tree_flex(q_index, k_index, k_end, square=False):
        mask = flex_block_mask(q_index, k_index, k_end, square=square)
        return lambda q, k, v: flex_tree_attention(q, k, v, mask, None)

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    if device.type != "cuda":
        backends = {"math": SDPBackend.MATH}
    if run.args.attention_rows == "all":  # the causal sweep and the chain piece ("tree": long_prefix's tree only)
        for n in lengths:
            index = torch.arange(n, device=device)
            kernels = {} if device.type != "cuda" else {"tree-flex": tree_flex(index, index, torch.full_like(index, n))}
            for name, backend in backends.items():
                kernels[f"sdpa-{name}"] = sdpa(backend)
                if name == "cudnn":
                    kernels["sdpa-cudnn-expanded"] = sdpa(backend, expand=True)
            measure(f"causal {n}", n, n, n * (n + 1) / 2, kernels)
        nq, prefix = prefix_shape
        nk = prefix + nq
        q_index = torch.arange(prefix, nk, device=device)
        k_index = torch.arange(nk, device=device)
        kernels = {}
        if device.type == "cuda":  # the engine's prefix call, and as whole tiles (PREFIX_AS_TILES)
            kernels["tree-flex-prefix"] = tree_flex(q_index, k_index, torch.full_like(k_index, nk))
            kernels["tree-flex-prefix-tiles"] = tree_flex(q_index, k_index, torch.full_like(k_index, nk), square=True)
        bias = causal_lower_right(nq, nk)
        for name, backend in backends.items():
            if name != "cudnn":
                kernels[f"sdpa-{name}-lower-right"] = sdpa(backend, bias=bias)
        measure(f"chain piece {nq} after {prefix}", nq, nk, nq * prefix + nq * (nq + 1) / 2, kernels)
    if device.type == "cuda":  # issue 24 item 2: long_prefix's whole tree in one call, against one causal sequence
        tree_attention(measure, device)
    return rows


def tree_attention(measure, device) -> None:
    """long_prefix's tree (43,485 tokens: a 32,000-token root chain, 8 responses) in one call, one
    layer: the tree mask through flex and the engine's route (the root split by default on CUDA),
    their TFLOP/s on the tree's visible pairs; the tree mask again on inputs padded to whole tiles
    (as the engine runs it with the split off); then SDPA's causal kernels on one sequence of the same
    length, on its causal pairs (the issue's reference rate)."""
    from treerl.engine import attention as attn
    from treerl.engine.rooted_trees import rooted_trees

    tree = PrefixTree.from_sequences(make_workload("long_prefix", SCALES["paper"], 1000))
    n = tree.num_tree_tokens
    index = torch.arange(n, device=device)
    k_end = tree.subtree_end.to(device)
    roots = rooted_trees(tree.subtree_end, 0)
    root = roots[0].root
    mask = attn.flex_block_mask(index, index, k_end)

    ctx = attn.TreeAttention("flex", index, index, k_end, roots=roots)  # once, as the engine's call (its masks)
    ctx.routes = collections.Counter()

    def engine_route(q, k, v):
        return attn._attend(ctx, q, k, v, None)

    kernels = {"tree-flex": lambda q, k, v: attn.flex_tree_attention(q, k, v, mask, None),
               f"tree-engine (root {root})": engine_route}
    measure(f"long_prefix tree {n}", n, n, tree.attention_pairs, kernels)
    print(f"  the engine's route on long_prefix's tree: {dict(ctx.routes)}", flush=True)
    tiles = -(-n // 128) * 128  # the engine pads a tree-mask call to whole flex tiles (FLEX_BLOCK)
    measure(f"long_prefix tree {n} on {tiles}", tiles, tiles, tree.attention_pairs,
            {"tree-flex (whole tiles)": lambda q, k, v: attn.flex_tree_attention(q, k, v, mask, None)})
    causal = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def fwd(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        causal[f"sdpa-{name}"] = fwd
    measure(f"causal {n}", n, n, n * (n + 1) / 2, causal)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model and sizes: the script end to end")
    ap.add_argument("--out", default=None, help="JSON results (rewritten after every row)")
    ap.add_argument("--workloads", default="long_prefix,episodes")
    ap.add_argument("--configs", default="auto,dfs,auto-noreuse,auto-tiles",
                    help=f"comma-separated: {', '.join(VARIANTS)}")
    ap.add_argument("--sections", default="sweep,workloads,attention")
    ap.add_argument("--attention-rows", choices=("all", "tree"), default="all",
                    help="attention section: every row, or long_prefix's tree only (its kernels and causal references)")
    ap.add_argument("--repeats", type=int, default=1, help="timed steps after one warm-up step")
    ap.add_argument("--max-seconds", type=float, default=400.0, help="skip what is left after this long")
    args = ap.parse_args(argv)
    run = Run(args)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    sections = args.sections.split(",")
    peak = None
    if device.type == "cuda":
        peak = matmul_peak(device)
        run.results.update(device=torch.cuda.get_device_name(device), peak_tflops=peak)
        print(f"{run.results['device']}: bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    shape = "tiny" if args.smoke else "qwen3-1.7b"
    model = build_model("qwen3", shape, dtype=dtype, device=device, seed=0)
    model.train()
    for p in model.parameters():  # gradients allocated up front: peaks include them, as a trainer's do
        p.grad = torch.zeros_like(p)
    smoke_budget = None
    if args.smoke:  # a budget under which the small shapes chain, recompute and keep attentions
        probe = TreeEngine(model)
        m = probe.memory.model
        smoke_budget = int(m.fixed + 1.5 * (probe.memory.call_budget.path_needs(600)[0] - m.fixed))
    run.results.update(model=shape, dtype=str(dtype))
    if "sweep" in sections:
        sweep(run, model, device, smoke_budget)
    if "attention" in sections and not run.over():  # short, before the long workload rows
        attention(run, device, dtype)
    if "workloads" in sections:
        workloads(run, model, device, peak, smoke_budget)
    if "vary" in sections and not run.over():
        vary(run, model, device, peak, smoke_budget)
    if device.type == "cuda":
        end = matmul_peak(device)
        run.results["peak_tflops_end"] = end
        best = max(peak, end)
        for row in run.results["sections"].get("workloads", []):
            if "tflops" in row:
                row["pct_peak"] = 100 * row["tflops"] / best
        print(f"bf16 matmul peak {peak:.0f} at the start, {end:.0f} at the end; % of {best:.0f}", flush=True)
    from treerl.engine import chain_attention as chain

    run.results["chain_probe"] = chain.PROBED
    run.results["wall_s"] = time.perf_counter() - run.t0
    run.save()
    print_tables(run.results)


def print_tables(results: dict) -> None:
    sections = results["sections"]
    print("\n| tree tokens | longest | budget GiB | modelled GiB | measured GiB | s | error |")
    print("|---|---|---|---|---|---|---|")
    for r in sections.get("sweep", []):
        print(f"| {r['tokens']} | {r['longest']} | {r['budget_gib']:.2f} | {r.get('predicted_gib', float('nan')):.2f} | "
              f"{r.get('measured_gib', float('nan')):.2f} | {r.get('seconds', float('nan')):.2f} | {r.get('error', '')} |")
    print("\n| workload | config | s | TFLOP/s | % peak | peak GiB | activations GiB | modelled GiB | calls | "
          "attention layer calls by route | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sections.get("workloads", []):
        if "seconds" not in r:
            print(f"| {r['workload']} | {r['config']} | | | | | | | | | {r.get('error')} |")
            continue
        routes = " ".join(f"{k}={v}" for k, v in r.get("attention", {}).items())
        print(f"| {r['workload']} | {r['config']} | {r['seconds']:.3f} | {r['tflops']:.1f} | {r.get('pct_peak', float('nan')):.1f} | "
              f"{r.get('peak_gib', float('nan')):.1f} | {r.get('activation_gib', float('nan')):.1f} | {r['predicted_gib']:.1f} | "
              f"{r['calls']} | {routes} | |")
    for what, verdict in results.get("chain_probe", {}).items():
        print(f"chain attention probe {what}: {verdict['chosen']} (rejected: {verdict['rejected']})")
    timed = {(r["workload"], r["config"]): r["seconds"] for r in sections.get("workloads", []) if "seconds" in r}
    for (wl, config), seconds in timed.items():
        if config in GENERAL and (wl, "auto") in timed:
            print(f"{wl}: {config} / auto = {seconds / timed[(wl, 'auto')]:.3f}x (non-separable / separable)")
    print("\n| shape | kernel | ms | TFLOP/s | max diff vs first | error |")
    print("|---|---|---|---|---|---|")
    for r in sections.get("attention", []):
        print(f"| {r['shape']} | {r['kernel']} | {r.get('ms', float('nan')):.2f} | {r.get('tflops', float('nan')):.1f} | "
              f"{r.get('max_diff_vs_first', '-')} | {r.get('error', '')} |")
    for r in sections.get("vary", []):
        steps = " ".join(f"{s['seconds']:.2f}s/+{s['new_kernel_shapes']}" for s in r["steps"])
        print(f"vary {r['workload']} {r['config']}: median {r.get('median_s', float('nan')):.3f} s after the first; "
              f"per step (seconds/new kernel shapes): {steps} {r.get('error', '')}")
    if "first_step_s" in results:
        print(f"\nfirst forward_backward of the process (compilation included): {results['first_step_s']:.1f} s")


if __name__ == "__main__":
    main()
