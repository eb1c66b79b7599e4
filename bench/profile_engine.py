"""Where one trainer step's time goes, and what each speed/memory option buys (issue 11).

One process, one model (random weights), the same batches through several engine
configurations; per row: seconds per forward+backward (median after a warm-up), peak
memory, unique-token TFLOP/s and % of the measured bf16 matmul peak; then a torch-profiler
breakdown of one step of the default engine by kernel kind (matmul, flex attention,
compiled fused kernels, eager elementwise, copies) against the wall time (host gaps).

    python bench/profile_engine.py --device cuda --shape qwen3-1.7b --dtype bfloat16 --out results/

Configurations: ``auto-8192-eager`` (the previous defaults: max_tokens 8192, no compile),
``auto-8192`` (+ compiled blocks), ``auto`` (today's defaults: compiled blocks, memory
budget, recompute where needed), ``dfs`` (chunk 2048), ``flat`` (defaults) and ``naive``
(one sequence per call through the model's own SDPA attention, the same loss head).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from treerl import PrefixTree, TreeEngine
from treerl.devtools.benchmark import NaiveLoop, time_forward_backward, useful_flops, weighted_logprob_loss
from treerl.engine import loss_head
from treerl.models import build_model
from treerl.devtools.workloads import SCALES, make_workload

CONFIGS = {
    "auto-8192-eager": dict(mode="auto", max_tokens=8192, compile=False),
    "auto-8192": dict(mode="auto", max_tokens=8192),
    "auto": dict(mode="auto"),
    "dfs": dict(mode="dfs"),
    "flat": dict(mode="flat"),
}


class _PackedToMaxTokens(TreeEngine):
    """The plan before ``pack_tokens``: several trees per call up to ``max_tokens``."""

    @property
    def pack_tokens(self) -> int:
        return self.max_tokens


def make_engine(model, name: str) -> TreeEngine:
    """The engine of a configuration name, for A/Bs in one run: a ``-nokeep`` suffix
    recomputes every layer's attention with its block (before kept attentions), a
    ``-maxpack`` suffix packs trees up to ``max_tokens`` (before ``pack_tokens``); ``-nofused``
    (:func:`loss_for`) hides the loss's ``token_loss`` (the head computes its logits again in
    the backward, as before the fused head); ``-inductorhead`` (:func:`head_kernels`) runs the
    head's chunks through inductor's kernels (before session 23's Triton kernels)."""
    nokeep, maxpack = "-nokeep" in name, "-maxpack" in name
    for suffix in ("-nokeep", "-maxpack", "-nofused", "-inductorhead"):
        name = name.replace(suffix, "")
    engine = (_PackedToMaxTokens if maxpack else TreeEngine)(model, **engine_config(name))
    if nokeep:
        engine.memory.kept_attention_layers = lambda queries, keys, copies, spare, **kw: frozenset()
    return engine


def engine_config(name: str) -> dict:
    """A named configuration, or ``MODE-bFRACTION`` (e.g. ``auto-b0.3``: a memory budget
    of 30% of the device); either with ``@BACKEND`` for an attention backend (``auto@flash``)."""
    name, _, attention = name.partition("@")
    extra = dict(attention=attention) if attention else {}
    if name in CONFIGS:
        return {**CONFIGS[name], **extra}
    mode, _, budget = name.partition("-b")
    return dict(mode=mode, memory_budget=float(budget), **extra)


@contextlib.contextmanager
def head_kernels(name: str):
    """Around a ``-inductorhead`` configuration's steps: the loss head's compiled chunks through
    inductor's kernels (``loss_head._COMPILED``) instead of :mod:`treerl.engine.head_kernel`'s."""
    if "-inductorhead" not in name:
        yield
        return
    before = loss_head._kernels
    loss_head._kernels = lambda compiled, hidden: loss_head._COMPILED if compiled else before(compiled, hidden)
    try:
        yield
    finally:
        loss_head._kernels = before


def loss_for(loss_fn, name: str):
    """The configuration's loss: without ``token_loss`` for a ``-nofused`` name."""
    return (lambda *a, **kw: loss_fn(*a, **kw)) if "-nofused" in name else loss_fn


def workload(name: str, vocab: int, scale: str):
    return make_workload(name, SCALES[scale], vocab)


def matmul_peak(device, warmup_s: float = 3.0, rounds: int = 5, products: int = 20) -> float:
    """TFLOP/s of a bf16 8192^3 product: the best of ``rounds`` timed rounds after
    ``warmup_s`` seconds of products (an idle GPU's clocks take a while to rise: with 3
    products of warm-up an H100 measured 660 where, warm, it measured 705)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup_s:
        a @ b
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(products):
            a @ b
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / products)
    return 2 * 8192**3 / best / 1e12


KINDS = [
    ("attention (flex)", ("flex", "tem_fused")),
    ("attention (sdpa/flash)", ("flash", "fmha", "attention", "cudnn")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "sm90", "cublas", "splitk")),
    ("compiled fused", ("triton_poi", "triton_red", "triton_per")),
    ("copies", ("memcpy", "memset", "copy")),
    ("eager elementwise/reduce", ("elementwise", "reduce", "vectorized", "index", "scatter", "gather", "softmax",
                                  "cat", "where", "fill")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_step(engine, tree, loss_fn, out: Path | None, label: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine.forward_backward(tree, loss_fn, separable=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.forward_backward(tree, loss_fn, separable=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    engine.model.zero_grad(set_to_none=False)
    by_kind: dict[str, float] = {}
    kernels = 0
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if evt.device_type == torch.autograd.DeviceType.CUDA and t > 0:
            by_kind[kind_of(evt.key)] = by_kind.get(kind_of(evt.key), 0.0) + t / 1e6
            kernels += evt.count
    busy = sum(by_kind.values())
    if out is not None:
        (out / f"kernels_{label.replace(':', '_')}.txt").write_text(
            prof.key_averages().table(sort_by="cuda_time_total", row_limit=80, max_name_column_width=240))
    return dict(wall_s=wall, gpu_busy_s=busy, host_gap_s=wall - busy, kernels=kernels,
                by_kind={k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--scale", default="paper")
    ap.add_argument("--workloads", default="grpo,agentic,long")
    ap.add_argument("--configs", default=",".join(CONFIGS) + ",naive")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", default="grpo:auto-8192,agentic:auto",
                    help="WORKLOAD:CONFIG pairs to profile, comma-separated ('' = none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    peak = matmul_peak(device)
    print(f"{torch.cuda.get_device_name(device)}: measured bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    model = build_model("qwen3", args.shape, dtype=args.dtype, device=device)
    model.train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    vocab = model.get_input_embeddings().num_embeddings
    results = dict(device=torch.cuda.get_device_name(device), peak_tflops=peak, shape=args.shape, rows=[])
    for wl in args.workloads.split(","):
        seqs = workload(wl, vocab, args.scale)
        tree = PrefixTree.from_sequences(seqs)
        loss_fn = weighted_logprob_loss(tree)
        flops = useful_flops(model, tree)
        print(f"\n{wl}: {tree.num_sequences} seqs, {tree.num_flat_tokens} flat / {tree.num_tree_tokens} tree tokens, "
              f"ideal {tree.ideal_ratio:.2f}", flush=True)
        for name in args.configs.split(","):
            row = dict(workload=wl, config=name, flat_tokens=tree.num_flat_tokens, tree_tokens=tree.num_tree_tokens,
                       ideal=tree.ideal_ratio)
            t0 = time.perf_counter()
            try:
                if name == "naive":
                    model.config._attn_implementation = "sdpa"
                    seconds, times, peak_bytes = time_forward_backward(NaiveLoop(model), tree, loss_fn, 1, 1)
                    row.update(seconds=seconds, times=times, peak_gib=peak_bytes / 2**30)
                else:
                    engine = make_engine(model, name)
                    with head_kernels(name):
                        seconds, times, peak_bytes = time_forward_backward(engine, tree, loss_for(loss_fn, name),
                                                                           args.repeats, 1)
                    row.update(seconds=seconds, times=times, peak_gib=peak_bytes / 2**30, calls=engine.stats.model_calls,
                               recomputed_calls=engine.stats.recomputed_calls,
                               kept_attention_layers=engine.stats.kept_attention_layers, plan=engine.stats.plan,
                               max_tokens=engine.memory.max_tokens)
                    if engine.memory.budget is not None:
                        m = engine.memory.model
                        row.update(budget_gib=engine.memory.budget / 2**30, bytes_per_token=m.per_token,
                                   recompute_bytes_per_token=m.recompute_per_token, fixed_bytes=m.fixed)
                row.update(tflops=flops / row["seconds"] / 1e12)
                row["pct_peak"] = 100 * row["tflops"] / peak
            except Exception as exc:  # a result, not a crash
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                traceback.print_exc()
                torch.cuda.empty_cache()
            row["wall_incl_warmup_s"] = time.perf_counter() - t0
            results["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "times"}), flush=True)
            if out:
                (out / "profile_engine.json").write_text(json.dumps(results, indent=1))
            model.zero_grad(set_to_none=False)
    results["profile"] = {}
    for pair in filter(None, args.profile.split(",")):
        wl, name = pair.split(":")
        tree = PrefixTree.from_sequences(workload(wl, vocab, args.scale))
        with head_kernels(name):
            prof = profile_step(make_engine(model, name), tree, loss_for(weighted_logprob_loss(tree), name), out, pair)
        prof["tflops"] = useful_flops(model, tree) / prof["wall_s"] / 1e12
        results["profile"][pair] = prof
        print(pair, json.dumps(prof, indent=1), flush=True)
        if out:
            (out / "profile_engine.json").write_text(json.dumps(results, indent=1))
    try:
        import torch._dynamo.utils as du
        results["dynamo"] = {k: dict(v) for k, v in du.counters.items() if k in ("stats", "graph_break", "recompiles")}
    except Exception:
        pass
    # measured again after the run (the GPU warm): % of peak below is of the higher of the two
    results["peak_tflops_end"] = matmul_peak(device)
    peak = max(peak, results["peak_tflops_end"])
    for r in results["rows"]:
        if "tflops" in r:
            r["pct_peak"] = 100 * r["tflops"] / peak
    print(f"bf16 matmul peak: {results['peak_tflops']:.0f} TFLOP/s at the start, {results['peak_tflops_end']:.0f} "
          f"at the end; % of {peak:.0f}", flush=True)
    if out:
        (out / "profile_engine.json").write_text(json.dumps(results, indent=1))
    print("\n| workload | config | s | TFLOP/s | % peak | peak GiB | vs flat | calls | recomputed | kept attn |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        flat = next((x for x in results["rows"] if x["workload"] == r["workload"] and x["config"] == "flat"
                     and "seconds" in x), None)
        if "seconds" not in r:
            print(f"| {r['workload']} | {r['config']} | {r.get('error')} |")
            continue
        vs = f"{flat['seconds'] / r['seconds']:.2f}" if flat else "-"
        print(f"| {r['workload']} | {r['config']} | {r['seconds']:.3f} | {r['tflops']:.0f} | {r['pct_peak']:.1f} | "
              f"{r['peak_gib']:.1f} | {vs} | {r.get('calls', '-')} | {r.get('recomputed_calls', '-')} | "
              f"{r.get('kept_attention_layers', '-')} |")


if __name__ == "__main__":
    sys.exit(main())
