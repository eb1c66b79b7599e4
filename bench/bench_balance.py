"""Tree-aware load balancing across data-parallel ranks (treerl.distributed: features, cost_model, partitioner).

Three parts:

(a) offline, CPU (default): for the ``grpo`` and ``agentic`` workloads and 2, 4, 8 ranks,
    the predicted seconds per rank of the tree-aware partition and of equal-token
    baselines, with the cost model given (default: the shipped H200 fit, see
    treerl/distributed/cost_model.py; ``--cost-model estimate`` for the FLOP estimate):

        python bench/bench_balance.py
        python bench/bench_balance.py --cost-model bench/results/cost_model_h200_qwen3-1.7b_bf16.json

(b) ``--fit``: time ``TreeEngine.forward_backward`` on random rank shares (1-3 trees of
    GRPO-like groups, agentic turn chains or unrelated sequences; 2,048 to 2 x max_tokens
    unique tokens) of a model shape,
    fit the cost model by non-negative least squares, report fit quality on held-out
    trees (every 4th) and save the JSON (one command, ~4 minutes on an H200):

        python bench/bench_balance.py --fit --device cuda

(c) ``--measure``: simulate N ranks on one GPU: time each rank's share of the batch
    sequentially with the engine, for the tree-aware and equal-token partitions, and
    report measured per-rank seconds and imbalance next to the predictions:

        python bench/bench_balance.py --measure --device cuda --ranks 4
        python bench/bench_balance.py --fit --measure --device cuda --ranks 2,4,8

The ``grpo``/``agentic`` workloads are those of ``treerl/workloads.py`` (scale ``paper``);
``mixed`` is grpo + agentic + none in one batch (seeds 0, 1, 2).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from treerl import PrefixTree
from treerl.distributed import (
    ESTIMATED_COST_MODEL,
    CostModel,
    Partition,
    default_cost_model,
    equal_token_partition,
    partition,
    tree_features,
)
from treerl.models import FAMILIES, SHAPES
from treerl.devtools.workloads import SCALES, make_workload

BASELINES = ("greedy", "contiguous", "trees")


def log(msg: str) -> None:
    print(msg, flush=True)


# =================================================================== (a) offline
def partitions(tree: PrefixTree, k: int, cm: CostModel, max_rank_tokens: int | None) -> dict[str, Partition]:
    out = {"tree-aware": partition(tree, k, cm, max_rank_tokens=max_rank_tokens)}
    for how in BASELINES:
        out[f"equal-tokens/{how}"] = equal_token_partition(tree, k, cm, how=how)
    return out


def workload_sequences(name: str, scale: str, vocab: int, seed: int) -> list[np.ndarray]:
    """A workload of treerl/workloads.py, or ``mixed``: grpo + agentic + none together
    (trees of different depths and sizes in one batch)."""
    if name == "mixed":
        return [s for i, w in enumerate(("grpo", "agentic", "none"))
                for s in make_workload(w, SCALES[scale], vocab, seed=seed + i)]
    return make_workload(name, SCALES[scale], vocab, seed=seed)


def offline(args, cm: CostModel) -> list[dict]:
    vocab = SHAPES[args.shape]["vocab_size"]
    rows = []
    log(f"cost model: {cm.describe()}")
    log("predicted seconds per forward_backward; 'max' = the step's time (slowest rank), "
        "imbalance = max / mean, work = sum over ranks, vs = that method's max / tree-aware max")
    for workload in args.workloads:
        seqs = workload_sequences(workload, args.scale, vocab, args.seed)
        tree = PrefixTree.from_sequences(seqs)
        one = cm.predict(tree_features(tree))
        log(f"\n{workload}: {tree} -- one rank: {one:.3f} s")
        head = f"{'ranks':>5}  {'method':<24}{'max s':>8}{'imbal.':>8}{'work s':>8}{'extra tok':>10}{'vs':>6}  per-rank s"
        log(head)
        log("-" * len(head))
        for k in args.ranks:
            parts = partitions(tree, k, cm, args.max_rank_tokens)
            ours = parts["tree-aware"].makespan
            for name, p in parts.items():
                per_rank = " ".join(f"{c:.3f}" for c in p.costs)
                log(f"{k:>5}  {name:<24}{p.makespan:>8.3f}{p.imbalance:>8.3f}{sum(p.costs):>8.3f}"
                    f"{p.extra_tokens:>10}{p.makespan / ours:>6.2f}  {per_rank}")
                rows.append(dict(workload=workload, ranks=k, method=name, makespan=p.makespan,
                                 imbalance=p.imbalance, work=sum(p.costs), extra_tokens=p.extra_tokens,
                                 costs=p.costs, pieces=len(p.pieces), split_trees=p.split_trees,
                                 one_rank=one))
    return rows


# ============================================================ engine and timing
def make_engine(args):
    import torch

    from treerl import TreeEngine
    from treerl.models import build_model

    device = torch.device(args.device)
    model = build_model(args.family, args.shape, dtype=args.dtype, device=device, seed=args.seed)
    model.train()
    for p in model.parameters():  # gradients allocated up front, as in training
        p.grad = torch.zeros_like(p)
    engine = TreeEngine(model, args.mode, max_tokens=args.max_tokens, chunk_tokens=args.chunk_tokens)
    return engine, model


def time_tree(engine, tree: PrefixTree, repeats: int, warmup: int, seed: int = 0) -> float:
    """Median seconds of one forward_backward (CUDA-synchronised), as treerl.devtools.benchmark."""
    from treerl.devtools.benchmark import time_forward_backward, weighted_logprob_loss

    seconds, _, _ = time_forward_backward(engine, tree, weighted_logprob_loss(tree, seed), repeats, warmup)
    return seconds


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "CPU"


def short_device(device: str) -> str:
    name = device_name(device)
    for tag in ("H200", "H100", "A100", "L40", "B200"):
        if tag in name:
            return tag.lower()
    return "cpu" if not device.startswith("cuda") else "gpu"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ======================================================================= (b) fit
def random_batch(rng: np.random.Generator, vocab: int, lo: int, hi: int, max_tree: int) -> list[np.ndarray]:
    """Sequences of a random rank share of about T unique tokens, T log-uniform in
    [lo, hi]: 1-3 trees (more if needed to keep each under ``max_tree`` tokens, the
    engine's budget: a rank runs several whole trees or pieces, rarely one huge tree)."""
    target = float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
    trees = max(math.ceil(target / max_tree), int(rng.integers(1, 4)))
    return [s for _ in range(trees) for s in random_tree_sequences(rng, vocab, target / trees)]


def random_tree_sequences(rng: np.random.Generator, vocab: int, target: float) -> list[np.ndarray]:
    """Sequences of one random tree (or forest) of about ``target`` unique tokens:
    GRPO-like groups, agentic turn chains, or unrelated sequences, so that tokens,
    attention pairs, nodes and leaves vary independently."""
    kind = rng.choice(["grpo", "agentic", "none"], p=[0.45, 0.35, 0.2])
    tok = lambda n: rng.integers(0, vocab, max(1, int(n)))  # noqa: E731
    seqs: list[np.ndarray] = []
    if kind == "grpo":
        prompts = int(rng.integers(1, 4))
        for _ in range(prompts):
            budget = target / prompts
            group = int(rng.integers(1, 17))
            prompt = tok(budget * rng.uniform(0.05, 0.7))
            rest = max(budget - len(prompt), group)
            for _ in range(group):
                seqs.append(np.concatenate([prompt, tok(rest / group * rng.uniform(0.5, 1.5))]))
    elif kind == "agentic":
        prefix = tok(target * rng.uniform(0.05, 0.5))
        trajectories, turns = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        per_turn = max((target - len(prefix)) / (trajectories * turns), 2)
        for _ in range(trajectories):
            conversation = prefix
            for _ in range(turns):
                conversation = np.concatenate([conversation, tok(per_turn * rng.uniform(0.5, 1.5))])
                seqs.append(conversation)
    else:
        count = int(rng.integers(1, 17))
        for _ in range(count):
            seqs.append(tok(target / count * rng.uniform(0.5, 1.5)))
    return seqs


def fit(args) -> CostModel:
    import torch

    t_start = time.perf_counter()
    engine, model = make_engine(args)
    vocab = model.get_input_embeddings().num_embeddings
    rng = np.random.default_rng(args.seed)
    lo, hi = args.fit_min_tokens, args.fit_max_tokens or 2 * args.max_tokens
    log(f"fit: {args.family} {args.shape} {args.dtype} on {device_name(args.device)}, mode {args.mode}, "
        f"max_tokens {args.max_tokens}; batches of {lo}..{hi} tokens; budget {args.budget_s:.0f} s")
    # Warm-up (compilation) on a small and a large batch, not measured.
    for size in (lo, hi):
        warm = random_batch(np.random.default_rng(size), vocab, size, size, args.max_tokens)
        time_tree(engine, PrefixTree.from_sequences(warm), repeats=1, warmup=1)
    log(f"warm-up done at {time.perf_counter() - t_start:.0f} s")
    feats, secs, calls = [], [], []
    t_measure = time.perf_counter()
    while len(secs) < args.max_trees and time.perf_counter() - t_measure < args.budget_s:
        tree = PrefixTree.from_sequences(random_batch(rng, vocab, lo, hi, args.max_tokens))
        try:
            s = time_tree(engine, tree, args.repeats, args.warmup, args.seed)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            log(f"  out of memory on {tree}: skipped")
            continue
        feats.append(tree_features(tree))
        secs.append(s)
        calls.append(engine.stats.model_calls)
        if len(secs) % 10 == 0:
            log(f"  {len(secs)} trees measured ({time.perf_counter() - t_start:.0f} s)")
    if len(secs) < 8:
        raise SystemExit(f"only {len(secs)} trees measured: raise --budget-s")
    secs_arr = np.array(secs)
    held = np.arange(len(secs)) % 4 == 3
    train = [f for f, h in zip(feats, held) if not h]
    test = [f for f, h in zip(feats, held) if h]
    train_fit = CostModel.fit(train, secs_arr[~held])
    held_stats = train_fit.quality(test, secs_arr[held])
    default_stats = {"estimate": ESTIMATED_COST_MODEL.quality(feats, secs_arr),
                     "shipped_default": default_cost_model().quality(feats, secs_arr)}
    dev = device_name(args.device)
    source = (f"fitted by bench/bench_balance.py --fit on {dev}: {args.family} {args.shape} {args.dtype}, "
              f"TreeEngine mode {args.mode} max_tokens {args.max_tokens}, {len(secs)} trees, "
              f"{time.strftime('%Y-%m-%d')}, commit {git_commit()}, torch {torch.__version__}")
    cm = CostModel.fit(feats, secs_arr, name=f"{args.shape} {args.dtype} {short_device(args.device)} ({args.mode})",
                       source=source)
    cm = CostModel(**{**asdict(cm), "fit_stats": {**cm.fit_stats, "held_out": held_stats,
                                                   "train_fit_on_train": train_fit.fit_stats,
                                                   "shipped_models_on_all": default_stats}})
    log(f"\nmeasured {len(secs)} trees in {time.perf_counter() - t_measure:.0f} s "
        f"({secs_arr.min():.3f}..{secs_arr.max():.3f} s per forward_backward)")
    log(f"fitted (all trees): {cm.describe()}")
    log(f"  fit on {len(train)} trees, held-out {len(test)}: R^2 {held_stats['r2']:.4f}, "
        f"max rel. error {held_stats['max_rel_err']:.3f}, mean {held_stats['mean_rel_err']:.3f}")
    log(f"  all trees: R^2 {cm.fit_stats['r2']:.4f}, max rel. error {cm.fit_stats['max_rel_err']:.3f}")
    for which, st in default_stats.items():
        log(f"  shipped {which} on the same trees: R^2 {st['r2']:.4f}, max rel. error "
            f"{st['max_rel_err']:.3f}, mean {st['mean_rel_err']:.3f}")
    out = args.out or Path(__file__).parent / "results" / (
        f"cost_model_{short_device(args.device)}_{args.shape}_{args.dtype.replace('bfloat16', 'bf16')}.json")
    cm.save(out)
    log(f"saved {out}")
    if args.json:
        _write_json(args.json, "fit", {"model": cm.to_dict(), "features": [asdict(f) for f in feats],
                                       "seconds": secs, "model_calls": calls,
                                       "held_out": held.tolist()})
    args._engine = (engine, model)  # reused by --measure in the same run
    return cm


# =================================================================== (c) measure
def measure(args, cm: CostModel) -> list[dict]:
    engine, model = getattr(args, "_engine", None) or make_engine(args)
    vocab = model.get_input_embeddings().num_embeddings
    rows: list[dict] = []
    t0 = time.perf_counter()
    log(f"\nmeasure: ranks simulated one after another on {device_name(args.device)}; "
        f"cost model {cm.name or 'default'}")
    for workload in args.workloads:
        seqs = workload_sequences(workload, args.scale, vocab, args.seed)
        tree = PrefixTree.from_sequences(seqs)
        time_tree(engine, tree, repeats=1, warmup=1)  # warm-up
        for k in args.ranks:
            log(f"\n{workload}, {k} ranks")
            head = (f"{'method':<24}{'meas. max':>10}{'imbal.':>8}{'pred. max':>10}{'imbal.':>8}"
                    f"{'max err':>9}  measured per rank s")
            log(head)
            log("-" * len(head))
            for name, p in partitions(tree, k, cm, args.max_rank_tokens).items():
                if time.perf_counter() - t0 > args.measure_budget_s:
                    log(f"measure budget of {args.measure_budget_s:.0f} s spent: stopping")
                    return rows
                measured = []
                for ids in p.ranks:
                    if not ids:
                        measured.append(0.0)
                        continue
                    share = PrefixTree.from_sequences([seqs[i] for i in ids])
                    measured.append(time_tree(engine, share, args.repeats, args.warmup, args.seed))
                mean = statistics.fmean(measured)
                errs = [abs(pc - m) / m for pc, m in zip(p.costs, measured) if m > 0]
                log(f"{name:<24}{max(measured):>10.3f}{max(measured) / mean:>8.3f}{p.makespan:>10.3f}"
                    f"{p.imbalance:>8.3f}{max(errs):>9.3f}  " + " ".join(f"{m:.3f}" for m in measured))
                rows.append(dict(workload=workload, ranks=k, method=name, measured=measured,
                                 predicted=p.costs, measured_max=max(measured),
                                 measured_imbalance=max(measured) / mean, predicted_max=p.makespan,
                                 predicted_imbalance=p.imbalance))
                if args.json:  # written as it goes: a run cut short keeps what it measured
                    _write_json(args.json, "measure", rows)
    return rows


# ========================================================================== main
def _write_json(path: Path, key: str, value) -> None:
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--fit", action="store_true", help="measure random trees and fit the cost model")
    p.add_argument("--measure", action="store_true", help="time each rank's share (N ranks on one device)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--family", default="qwen3", choices=list(FAMILIES))
    p.add_argument("--shape", default="qwen3-1.7b", choices=list(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    p.add_argument("--mode", default="auto", choices=["auto", "packed", "dfs", "flat"], help="engine mode")
    p.add_argument("--max-tokens", type=int, default=16384, help="engine micro-batch budget (tokens per call)")
    p.add_argument("--chunk-tokens", type=int, default=2048)
    p.add_argument("--scale", default="paper", choices=list(SCALES))
    p.add_argument("--workloads", default="grpo,agentic,mixed", help="grpo, agentic, none, mixed")
    p.add_argument("--ranks", default="2,4,8", help="comma-separated rank counts")
    p.add_argument("--max-rank-tokens", type=int, default=None, help="partition: most tokens of one piece")
    p.add_argument("--cost-model", type=Path, default=None,
                   help="cost model JSON, or 'estimate' (default: the shipped H200 fit)")
    p.add_argument("--out", type=Path, default=None, help="--fit: where to save the model JSON")
    p.add_argument("--budget-s", type=float, default=120.0, help="--fit: seconds of measuring trees")
    p.add_argument("--max-trees", type=int, default=200, help="--fit: most trees measured")
    p.add_argument("--fit-min-tokens", type=int, default=2048,
                   help="--fit: smallest batch (smaller calls are launch-bound, not linear; rank shares are larger)")
    p.add_argument("--fit-max-tokens", type=int, default=None, help="--fit: largest tree (default 2 x max-tokens)")
    p.add_argument("--measure-budget-s", type=float, default=420.0, help="--measure: stop after this long")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write results here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.ranks = [int(r) for r in str(args.ranks).split(",") if r]
    cm = ESTIMATED_COST_MODEL if str(args.cost_model) == "estimate" else default_cost_model(args.cost_model)
    if args.fit:
        cm = fit(args)
    if args.measure:
        measure(args, cm)
    if not (args.fit or args.measure):
        rows = offline(args, cm)
        if args.json:
            _write_json(args.json, "offline", rows)


if __name__ == "__main__":
    sys.exit(main())
