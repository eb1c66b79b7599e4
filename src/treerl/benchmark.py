"""Tree-vs-flat benchmark: the same batch through several engine modes in one process.

Prints, per workload and mode: sequences, flat tokens, tree tokens, ideal ratio (flat /
tree tokens), model calls, seconds per forward+backward (median), speedup vs ``flat``
measured in the same run, fraction of ideal (speedup / ideal ratio), peak memory (CUDA)
and achieved TFLOP/s on unique tokens. ``python -m treerl.benchmark --help``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .engine import TreeEngine
from .models import SHAPES, build_model
from .tree import PrefixTree
from .workloads import SCALES, WORKLOADS, make_workload

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, vendor datasheets


@dataclass
class BenchConfig:
    family: str = "qwen3"
    shape: str = "small"
    dtype: str = "float32"
    device: str = "cpu"
    scale: str = "small"
    workloads: tuple[str, ...] = WORKLOADS
    modes: tuple[str, ...] = ("flat", "packed")
    max_tokens: int = 8192
    chunk_tokens: int = 2048
    attention: str = "auto"
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    longest: bool = False  # also time flat on the single longest sequence (memory reference)


@dataclass
class BenchRow:
    workload: str
    mode: str
    sequences: int
    flat_tokens: int
    tree_tokens: int
    ideal_ratio: float
    calls: int
    seconds: float
    speedup: float = float("nan")
    fraction_of_ideal: float = float("nan")
    peak_gib: float | None = None
    tflops: float | None = None
    error: str | None = None
    times: list[float] = field(default_factory=list)


def useful_flops(model: torch.nn.Module, tree: PrefixTree) -> float:
    """Forward+backward FLOPs of the unique tree tokens: matmuls (6 x params x tokens),
    the LM head (6 x hidden x vocab per predicted token) and attention over visible pairs."""
    cfg = model.config
    head = model.get_output_embeddings().weight
    embed = model.get_input_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - embed.numel() - (0 if head is embed else head.numel())
    predicted = tree.num_tree_tokens - tree.num_roots
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * tree.attention_pairs
    return 6 * body * tree.num_tree_tokens + 6 * head.numel() * predicted + attn


def weighted_logprob_loss(tree: PrefixTree, seed: int = 0):
    """A separable loss: -sum(w * logprob) / tokens with fixed random per-token weights."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(tree.num_flat_tokens - tree.num_sequences, generator=gen, dtype=torch.float64)
    weights = list(weights.split((tree.seq_lengths - 1).tolist()))
    total = float(tree.num_flat_tokens - tree.num_sequences)

    on_device: dict = {}  # per device, copied once: a per-call copy would sync the host

    def loss_fn(logprobs, index=None):
        ids = range(len(logprobs)) if index is None else index.tolist()
        dev = logprobs[0].device
        if dev not in on_device:
            on_device[dev] = torch.cat(weights).to(dev).split([len(w) for w in weights])
        w = on_device[dev]
        return -sum((lp * w[i].to(lp.dtype)).sum() for lp, i in zip(logprobs, ids)) / total

    return loss_fn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward_backward(engine: TreeEngine, tree: PrefixTree, loss_fn, repeats: int, warmup: int):
    """Median seconds of forward_backward, the samples, and peak CUDA bytes (None on CPU)."""
    device = engine.device
    model = engine.model
    for _ in range(warmup):
        engine.forward_backward(tree, loss_fn, separable=True)
    model.zero_grad(set_to_none=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        engine.forward_backward(tree, loss_fn, separable=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    model.zero_grad(set_to_none=False)
    return statistics.median(times), times, peak


def run(cfg: BenchConfig, model: torch.nn.Module | None = None, progress: bool = True) -> list[BenchRow]:
    device = torch.device(cfg.device)
    if model is None:
        model = build_model(cfg.family, cfg.shape, dtype=cfg.dtype, device=device, seed=cfg.seed)
    model.train()
    for p in model.parameters():  # allocate grads up front so every mode's peak includes them
        p.grad = torch.zeros_like(p)
    spec = SCALES[cfg.scale]
    vocab = model.get_input_embeddings().num_embeddings
    peak_tflops = next((v for k, v in PEAK_BF16_TFLOPS.items() if device.type == "cuda" and k in torch.cuda.get_device_name(device)), None)
    rows: list[BenchRow] = []
    jobs = [(w, m) for w in cfg.workloads for m in cfg.modes + (("longest",) if cfg.longest else ())]
    bar = _progress(jobs, progress)
    for workload, mode in bar:
        seqs = make_workload(workload, spec, vocab, seed=cfg.seed)
        if mode == "longest":  # flat on the longest sequence alone: the memory reference
            seqs = [max(seqs, key=len)]
        tree = PrefixTree.from_sequences(seqs)
        loss_fn = weighted_logprob_loss(tree, cfg.seed)
        engine = TreeEngine(
            model, "flat" if mode == "longest" else mode, max_tokens=cfg.max_tokens,
            chunk_tokens=cfg.chunk_tokens, attention=cfg.attention,
        )
        row = BenchRow(workload, mode, tree.num_sequences, tree.num_flat_tokens, tree.num_tree_tokens,
                       tree.ideal_ratio, calls=0, seconds=float("nan"))
        try:
            seconds, times, peak = time_forward_backward(engine, tree, loss_fn, cfg.repeats, cfg.warmup)
            row.seconds, row.times, row.calls = seconds, times, engine.stats.model_calls
            row.peak_gib = None if peak is None else peak / 2**30
            row.tflops = useful_flops(model, tree) / seconds / 1e12
        except torch.OutOfMemoryError as exc:  # a result, not a crash: record and go on
            row.error = f"out of memory: {str(exc).splitlines()[0][:80]}"
            torch.cuda.empty_cache()
        rows.append(row)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(workload=workload, mode=mode, s=f"{row.seconds:.3f}")
    for row in rows:
        flat = next((r for r in rows if r.workload == row.workload and r.mode == "flat"), None)
        if flat is not None and row.mode != "longest" and not row.error and not flat.error:
            row.speedup = flat.seconds / row.seconds
            row.fraction_of_ideal = row.speedup / row.ideal_ratio
    if peak_tflops:
        for row in rows:
            row.mfu = None if row.tflops is None else row.tflops / peak_tflops
    return rows


def _progress(items, enabled: bool):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc="bench", unit="run", file=sys.stderr)


def format_table(rows: list[BenchRow]) -> str:
    head = ["workload", "mode", "seqs", "flat tok", "tree tok", "ideal", "calls", "s/step", "speedup",
            "of ideal", "peak GiB", "TFLOP/s"]
    lines = [head]
    for r in rows:
        fmt = lambda x, f: "-" if x is None or x != x else format(x, f)  # noqa: E731
        lines.append([
            r.workload, r.mode, str(r.sequences), str(r.flat_tokens), str(r.tree_tokens),
            f"{r.ideal_ratio:.2f}", str(r.calls), r.error or fmt(r.seconds, ".4f"), fmt(r.speedup, ".2f"),
            fmt(r.fraction_of_ideal, ".2f"), fmt(r.peak_gib, ".1f"), fmt(r.tflops, ".1f"),
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="treerl bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = BenchConfig()
    p.add_argument("--family", default=d.family, choices=["qwen3", "qwen2", "llama"])
    p.add_argument("--shape", default=d.shape, choices=list(SHAPES))
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float64"])
    p.add_argument("--device", default=d.device)
    p.add_argument("--scale", default=d.scale, choices=list(SCALES))
    p.add_argument("--workloads", default=",".join(d.workloads), help="comma-separated: grpo,agentic,none")
    p.add_argument("--modes", default=",".join(d.modes), help="comma-separated: flat,packed,dfs,auto")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens)
    p.add_argument("--attention", default=d.attention, choices=["auto", "sdpa", "flex"])
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--longest", action="store_true", help="also run flat on the longest sequence alone")
    p.add_argument("--json", type=Path, help="also write the rows here")
    return p


def main(argv: list[str] | None = None) -> list[BenchRow]:
    args = parser().parse_args(argv)
    cfg = BenchConfig(
        family=args.family, shape=args.shape, dtype=args.dtype, device=args.device, scale=args.scale,
        workloads=tuple(args.workloads.split(",")), modes=tuple(args.modes.split(",")),
        max_tokens=args.max_tokens, chunk_tokens=args.chunk_tokens, attention=args.attention,
        repeats=args.repeats, warmup=args.warmup, seed=args.seed, longest=args.longest,
    )
    if "flat" not in cfg.modes:
        cfg.modes = ("flat",) + cfg.modes  # the baseline is always measured in the same run
    rows = run(cfg)
    device = torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else "CPU"
    print(f"\ntreerl bench: {cfg.family} {cfg.shape} {cfg.dtype} on {device}, scale {cfg.scale}, "
          f"max_tokens {cfg.max_tokens}, chunk_tokens {cfg.chunk_tokens}")
    print(format_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": asdict(cfg), "device": device,
                                         "rows": [asdict(r) for r in rows]}, indent=1))
    return rows


if __name__ == "__main__":
    main()
