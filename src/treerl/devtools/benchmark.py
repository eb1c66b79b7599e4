"""Tree-vs-flat benchmark: the same batch through several engine modes in one process.

Prints, per workload and mode: sequences, flat tokens, tree tokens, ideal ratio (flat /
tree tokens), model calls, seconds per forward+backward (median), speedup vs ``flat`` and
vs ``naive`` measured in the same run, fraction of ideal (speedup / ideal ratio), peak
memory (CUDA), achieved TFLOP/s on unique tokens and its share of ``--peak-tflops``.
``python -m treerl.devtools.benchmark --help``.

Modes: the engine modes (``flat``, ``packed``, ``dfs``, ``auto``) and ``naive``: one
sequence per model call through the model's own forward (Hugging Face SDPA attention,
causal, no tree mask, default positions), the same chunked loss head and the same loss,
backward after each sequence; nothing batched, nothing shared, no memory budget. It is
what a user without treerl would write; ``flat`` should never be slower.
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

from ..engine.tree_engine import StepStats, TreeEngine
from ..engine.loss_head import token_logprobs
from ..models import FAMILIES, SHAPES, build_model, decoder_of
from ..engine.plan import MODES as ENGINE_MODES, TreeTooLargeError
from ..engine.tree import PrefixTree
from .workloads import SCALES, WORKLOADS, make_workload

# Measured bf16 dense matmul peak of an H100/H200 (DESIGN.md); the datasheet says 989.
DEFAULT_PEAK_TFLOPS = 798.0
BENCH_MODES = ("naive",) + ENGINE_MODES
# the long shapes (long_prefix, episodes: ~1M flat tokens) run when named
DEFAULT_WORKLOADS = ("grpo", "agentic", "none", "long", "tree")


@dataclass
class BenchConfig:
    family: str = "qwen3"
    shape: str = "small"
    dtype: str = "float32"
    device: str = "cpu"
    scale: str = "small"
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    modes: tuple[str, ...] = ("naive", "flat", "packed", "auto")
    max_tokens: int | None = None  # None: the engine's default (from the memory budget)
    memory_budget: float | None = None  # None: the engine's default
    chunk_tokens: int = 2048
    peak_tflops: float = DEFAULT_PEAK_TFLOPS
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
    vs_naive: float = float("nan")  # naive seconds / these seconds
    peak_gib: float | None = None
    tflops: float | None = None
    pct_of_peak: float | None = None  # tflops / --peak-tflops, in percent
    max_tokens: int | None = None  # the engine's tokens per call (resolved)
    tokens_run: int | None = None  # tokens through the model in one step (all passes)
    plan: str = ""
    error: str | None = None
    times: list[float] = field(default_factory=list)


def matmul_params(model: torch.nn.Module) -> tuple[int, int]:
    """(non-embedding parameters of the body, LM head parameters): the matmul weights a
    token goes through."""
    head = model.get_output_embeddings().weight
    embed = model.get_input_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - embed.numel() - (0 if head is embed else head.numel())
    return body, head.numel()


def attention_flops_per_pair(model: torch.nn.Module) -> int:
    """Forward+backward attention FLOPs per (query, visible key) pair, all layers."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim


def useful_flops(model: torch.nn.Module, tree: PrefixTree) -> float:
    """Forward+backward FLOPs of the unique tree tokens (DESIGN.md): matmuls (6 x
    non-embedding params per token), the LM head (6 x hidden x vocab per predicted token)
    and attention (12 x heads x head_dim x layers per visible (query, key) pair).
    Recomputation is not counted."""
    body, head = matmul_params(model)
    predicted = tree.num_tree_tokens - tree.num_roots
    attn = attention_flops_per_pair(model) * tree.attention_pairs
    return 6 * body * tree.num_tree_tokens + 6 * head * predicted + attn


class NaiveLoop:
    """The naive baseline: one sequence per model call with the model's own attention.

    Per sequence: the base model's forward (its configured attention, SDPA: causal, no
    mask, positions 0..L-1), the treerl chunked loss head (:func:`token_logprobs`, the
    same one the engine uses, compiled on CUDA as the engine's is), the loss of that
    sequence alone (``index=[i]``), backward. Same interface as the engine's
    ``forward_backward`` for the timing code."""

    mode = "naive"

    def __init__(self, model: torch.nn.Module, compiled_head: bool | None = None):
        self.model = model
        self.head = model.get_output_embeddings()
        self.device = self.head.weight.device
        self.compiled_head = self.device.type == "cuda" if compiled_head is None else compiled_head
        self.stats = StepStats(mode="naive")

    def forward_backward(self, tree: PrefixTree, loss_fn, *, separable: bool = True) -> float:
        if not separable:
            raise ValueError("the naive loop runs one sequence at a time: it needs a separable loss")
        impl = self.model.config._attn_implementation
        if impl != "sdpa":
            raise ValueError(f"the naive baseline runs the model's SDPA attention; this model uses {impl!r}")
        t0 = time.perf_counter()
        lengths = tree.seq_lengths.tolist()
        seqs = torch.cat(tree.sequences()).to(self.device).split(lengths)  # one host-to-device copy
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, ids in enumerate(seqs):
            if len(ids) < 2:
                continue  # nothing to predict
            hidden = decoder_of(self.model)(input_ids=ids[None], use_cache=False).last_hidden_state[0]
            lp, _ = token_logprobs(hidden[:-1], self.head.weight, ids[1:], compiled=self.compiled_head)
            loss = loss_fn([lp], index=torch.tensor([i]))
            loss.backward()
            total += loss.detach().to(torch.float64)
        calls = sum(1 for n in lengths if n >= 2)
        self.stats = StepStats(mode="naive", plan=f"naive: {calls} calls, one per sequence", model_calls=calls,
                               tokens_run=sum(n for n in lengths if n >= 2), seconds=time.perf_counter() - t0)
        return float(total)


def make_runner(model: torch.nn.Module, mode: str, *, max_tokens: int | None = None,
                memory_budget: float | None = None, chunk_tokens: int = 2048, attention: str = "auto"):
    """A TreeEngine for an engine mode, or the :class:`NaiveLoop` for ``naive``."""
    if mode == "naive":
        return NaiveLoop(model)
    kw = dict(max_tokens=max_tokens) if max_tokens is not None else dict(memory_budget=memory_budget)
    return TreeEngine(model, mode, chunk_tokens=chunk_tokens, attention=attention, **kw)


def weighted_logprob_loss(tree: PrefixTree, seed: int = 0):
    """A separable loss: -sum(w * logprob) / tokens with fixed random per-token weights.
    A sum of per-token terms: it offers ``token_loss`` (:mod:`treerl.engine.token_loss`)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (tree.seq_lengths - 1).tolist()
    weights = torch.randn(tree.num_flat_tokens - tree.num_sequences, generator=gen, dtype=torch.float64)
    total = float(tree.num_flat_tokens - tree.num_sequences)

    on_device: dict = {}  # per device, copied once (flat, and per sequence): a per-call copy would sync the host

    def weights_on(dev):
        if dev not in on_device:
            flat = weights.to(dev)
            on_device[dev] = flat, flat.split(lengths)
        return on_device[dev]

    def value(logprob, w):
        return -(logprob * w.to(logprob.dtype)).sum() / total

    def token_loss(logprob, entropy, tokens):
        return value(logprob, weights_on(logprob.device)[0][tokens])

    def loss_fn(logprobs, index=None):
        ids = range(len(logprobs)) if index is None else index.tolist()
        per_seq = weights_on(logprobs[0].device)[1]
        return value(torch.cat(list(logprobs)), torch.cat([per_seq[i] for i in ids]))

    loss_fn.token_loss = token_loss
    return loss_fn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward_backward(engine, tree: PrefixTree, loss_fn, repeats: int, warmup: int, separable: bool = True):
    """Median seconds of forward_backward (a TreeEngine or NaiveLoop), the samples, and peak
    CUDA bytes over the timed repeats (None on CPU). ``separable=False``: the general path
    (the loss called once on every sequence)."""
    device = engine.device
    model = engine.model
    for _ in range(warmup):
        engine.forward_backward(tree, loss_fn, separable=separable)
    model.zero_grad(set_to_none=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        engine.forward_backward(tree, loss_fn, separable=separable)
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    model.zero_grad(set_to_none=False)
    return statistics.median(times), times, peak


def run(cfg: BenchConfig, model: torch.nn.Module | None = None, progress: bool = True, on_row=None) -> list[BenchRow]:
    """Every (workload, mode) of ``cfg``; ``on_row(rows)`` after each (e.g. to save partial results)."""
    device = torch.device(cfg.device)
    if model is None:
        model = build_model(cfg.family, cfg.shape, dtype=cfg.dtype, device=device, seed=cfg.seed)
    model.train()
    for p in model.parameters():  # allocate grads up front so every mode's peak includes them
        p.grad = torch.zeros_like(p)
    spec = SCALES[cfg.scale]
    vocab = model.get_input_embeddings().num_embeddings
    for name in cfg.workloads:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    for mode in cfg.modes:
        if mode not in BENCH_MODES:
            raise ValueError(f"unknown mode {mode!r}: choose from {', '.join(BENCH_MODES)}")
    rows: list[BenchRow] = []
    jobs = [(w, m) for w in cfg.workloads for m in cfg.modes + (("longest",) if cfg.longest else ())]
    bar = _progress(jobs, progress)
    for workload, mode in bar:
        seqs = make_workload(workload, spec, vocab, seed=cfg.seed)
        if mode == "longest":  # flat on the longest sequence alone: the memory reference
            seqs = [max(seqs, key=len)]
        tree = PrefixTree.from_sequences(seqs)
        loss_fn = weighted_logprob_loss(tree, cfg.seed)
        engine = make_runner(model, "flat" if mode == "longest" else mode, max_tokens=cfg.max_tokens,
                             memory_budget=cfg.memory_budget, chunk_tokens=cfg.chunk_tokens, attention=cfg.attention)
        row = BenchRow(workload, mode, tree.num_sequences, tree.num_flat_tokens, tree.num_tree_tokens,
                       tree.ideal_ratio, calls=0, seconds=float("nan"))
        try:
            seconds, times, peak = time_forward_backward(engine, tree, loss_fn, cfg.repeats, cfg.warmup)
            row.seconds, row.times, row.calls = seconds, times, engine.stats.model_calls
            row.tokens_run, row.plan = engine.stats.tokens_run, engine.stats.plan
            row.max_tokens = engine.memory.max_tokens if isinstance(engine, TreeEngine) else None
            row.peak_gib = None if peak is None else peak / 2**30
            row.tflops = useful_flops(model, tree) / seconds / 1e12
            row.pct_of_peak = 100 * row.tflops / cfg.peak_tflops if cfg.peak_tflops else None
        except torch.OutOfMemoryError as exc:  # a result, not a crash: record and go on
            row.error = f"out of memory: {str(exc).splitlines()[0][:80]}"
            model.zero_grad(set_to_none=False)
            torch.cuda.empty_cache()
        except TreeTooLargeError as exc:  # packed: a tree over the budget
            row.error = "refused: " + str(exc).split(":")[0]
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        if progress and hasattr(bar, "write"):
            bar.write(f"{workload:>8} {mode:>7}: {row.error or f'{row.seconds:.3f} s'}  {row.plan}")
    for row in rows:
        same = {r.mode: r for r in rows if r.workload == row.workload and not r.error}
        if row.error or row.mode == "longest":
            continue
        if "flat" in same:
            row.speedup = same["flat"].seconds / row.seconds
            row.fraction_of_ideal = row.speedup / row.ideal_ratio
        if "naive" in same:
            row.vs_naive = same["naive"].seconds / row.seconds
    return rows


def _progress(items, enabled: bool):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc="bench", unit="run", file=sys.stderr)


def format_table(rows: list[BenchRow]) -> str:
    head = ["workload", "mode", "seqs", "flat tok", "tree tok", "ideal", "calls", "s/step", "vs flat",
            "of ideal", "vs naive", "peak GiB", "TFLOP/s", "% peak"]
    lines = [head]
    for r in rows:
        fmt = lambda x, f: "-" if x is None or x != x else format(x, f)  # noqa: E731
        lines.append([
            r.workload, r.mode, str(r.sequences), str(r.flat_tokens), str(r.tree_tokens),
            f"{r.ideal_ratio:.2f}", str(r.calls), r.error or fmt(r.seconds, ".4f"), fmt(r.speedup, ".2f"),
            fmt(r.fraction_of_ideal, ".2f"), fmt(r.vs_naive, ".2f"), fmt(r.peak_gib, ".1f"), fmt(r.tflops, ".3g"),
            fmt(r.pct_of_peak, ".3g"),
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="treerl bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = BenchConfig()
    p.add_argument("--family", default=d.family, choices=list(FAMILIES))
    p.add_argument("--shape", default=d.shape, choices=list(SHAPES))
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float64"])
    p.add_argument("--device", default=d.device)
    p.add_argument("--scale", default=d.scale, choices=list(SCALES))
    p.add_argument("--workloads", default=",".join(d.workloads), help=f"comma-separated: {','.join(WORKLOADS)}")
    p.add_argument("--modes", default=",".join(d.modes), help=f"comma-separated: {','.join(BENCH_MODES)}")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="tokens per call (advanced override); default: the engine's, from the memory budget")
    p.add_argument("--memory-budget", type=float, default=d.memory_budget,
                   help="activation memory budget: a fraction of the device memory (<= 1) or bytes; default: the engine's")
    p.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens)
    p.add_argument("--peak-tflops", type=float, default=d.peak_tflops,
                   help="the device's measured bf16 matmul peak, for the %% peak column (H100/H200: ~798)")
    p.add_argument("--attention", default=d.attention, choices=["auto", "sdpa", "flex"])
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--longest", action="store_true", help="also run flat on the longest sequence alone")
    p.add_argument("--json", type=Path, help="also write the rows here")
    return p


def main(argv: list[str] | None = None) -> list[BenchRow]:
    p = parser()
    args = p.parse_args(argv)
    workloads = tuple(w for w in args.workloads.split(",") if w)
    modes = tuple(m for m in args.modes.split(",") if m)
    for name, given, known in (("workload", workloads, WORKLOADS), ("mode", modes, BENCH_MODES)):
        bad = [x for x in given if x not in known]
        if bad or not given:
            p.error(f"unknown {name} {', '.join(bad) or '(none given)'}: choose from {', '.join(known)}")
    cfg = BenchConfig(
        family=args.family, shape=args.shape, dtype=args.dtype, device=args.device, scale=args.scale,
        workloads=workloads, modes=modes, max_tokens=args.max_tokens, memory_budget=args.memory_budget,
        chunk_tokens=args.chunk_tokens, peak_tflops=args.peak_tflops, attention=args.attention,
        repeats=args.repeats, warmup=args.warmup, seed=args.seed, longest=args.longest,
    )
    if "flat" not in cfg.modes:
        cfg.modes = ("flat",) + cfg.modes  # the baseline is always measured in the same run
    device = torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else "CPU"

    def save(rows: list[BenchRow]) -> None:  # after every row: a run cut short keeps what it measured
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"config": asdict(cfg), "device": device, "torch": torch.__version__,
                                             "rows": [asdict(r) for r in rows]}, indent=1))

    rows = run(cfg, on_row=save)
    save(rows)  # with the ratios filled in
    budget = f"max_tokens {cfg.max_tokens}" if cfg.max_tokens else (
        f"memory budget {cfg.memory_budget or 'default'} (tokens per call: "
        + ", ".join(sorted({str(r.max_tokens) for r in rows if r.max_tokens})) + ")")
    print(f"\ntreerl bench: {cfg.family} {cfg.shape} {cfg.dtype} on {device}, scale {cfg.scale}, "
          f"{budget}, chunk_tokens {cfg.chunk_tokens}, % of {cfg.peak_tflops:g} TFLOP/s")
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
