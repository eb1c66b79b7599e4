"""The DTA paper's open questions as two sweeps (issue 11, item 5a/5b), in one process.

(a) **sharing** — speed-up vs ``flat`` and unique-token TFLOP/s against the sharing
    ratio. Per point: ``groups`` prompts x ``G`` samples, every sequence ``L`` tokens; the
    prompt (the divergence point) is ``P`` tokens and each response ``L - P``, with
    ``P = G L (1 - 1/r) / (G - 1)`` so that the ideal ratio (flat / unique tokens)
    ``G L / (P + G (L - P))`` is the target ``r``: ``r = 1`` is no sharing at all
    (``P = 0``, every sequence starts with a distinct token), ``r = 16`` a long prompt
    with short responses. The flat token count is the same at every point, so ``flat``'s
    time is a constant. Every sibling set starts with distinct tokens: the divergence
    point is exact, and the measured ideal ratio is reported beside the target.
(b) **chunks** — ``chunk_tokens`` 512 ... 8192 for ``dfs``, ``auto`` (default memory
    budget: trees that fit its tokens per call never split, so the chunk rarely matters)
    and ``auto-fixed`` (``auto`` with ``max_tokens`` fixed below the trees' sizes, 8192 at
    ``paper``, the previous default: the prefix nodes run as chains of chunks, the
    subtrees below packed) on the ``agentic`` and ``long`` workloads of
    :mod:`treerl.devtools.workloads` with half their groups (to fit a GPU run in ~6 minutes):
    seconds, peak memory, and the FLOPs recomputed. (``auto`` with ``max_tokens`` = the
    chunk would plan exactly as ``dfs``.) Recomputed FLOPs =
    tokens the plan runs beyond the unique tree tokens (the two-phase no-grad forward,
    and no-grad captures of chains recomputed later) x 2 x (non-embedding + LM head
    params), plus tokens of calls whose decoder blocks are recomputed in the backward
    (activation checkpointing under the memory budget) x 2 x non-embedding params: every
    extra run is a forward. Attention FLOPs of the recomputation are not counted. Where a
    chunk size leaves the plan unchanged from the previous point, the row is that point's
    measurement again (marked ``same_plan_as``), not a new run.

Useful FLOPs and TFLOP/s follow DESIGN.md (:func:`treerl.devtools.benchmark.useful_flops`): matmuls
6 x (non-embedding + LM head params) per unique token, attention 12 x heads x head_dim x
layers per visible (query, key) pair; % of ``--peak-tflops``.

Writes ``sweeps.json`` (after every point) and ``sharing.png`` / ``chunks.png`` to
``--out``; prints a table per sweep and progress with the elapsed time to stderr.

    # CPU, seconds:
    PYTHONPATH=src python bench/bench_sweeps.py --shape tiny --scale small --out /tmp/sweeps
    # GPU (~6 min on an H100):
    PYTHONPATH=src python bench/bench_sweeps.py --device cuda --shape qwen3-1.7b \\
        --dtype bfloat16 --scale paper --out $OUT/sweeps --max-seconds 420
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from treerl import PrefixTree, TreeEngine
from treerl.devtools.benchmark import (
    DEFAULT_PEAK_TFLOPS,
    matmul_params,
    time_forward_backward,
    useful_flops,
    weighted_logprob_loss,
)
from treerl.models import FAMILIES, SHAPES, build_model
from treerl.devtools.workloads import SCALES, distinct_starts, make_workload

# (groups, G samples, sequence length L) of the sharing sweep, per workload scale.
SHARING_SHAPES = {"paper": (1, 32, 1024), "small": (1, 32, 96), "tiny": (1, 24, 48)}
RATIOS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16)
SHARING_MODES = ("flat", "dfs", "auto")
CHUNKS = {"paper": (512, 1024, 2048, 4096, 8192), "small": (64, 128, 256, 512, 1024), "tiny": (2, 4, 8, 16, 32)}
CHUNK_MODES = ("dfs", "auto", "auto-fixed")
AUTO_FIXED_TOKENS = {"paper": 8192, "small": 256, "tiny": 16}  # auto-fixed's max_tokens, per scale
CHUNK_WORKLOADS = ("agentic", "long")


def sharing_sequences(ratio: float, groups: int, samples: int, length: int, vocab: int, seed: int = 0):
    """``groups`` x ``samples`` sequences of ``length`` tokens whose ideal ratio is ~``ratio``.
    Returns (sequences, prompt length)."""
    if samples < 2 or not 1 <= ratio <= samples:
        raise ValueError(f"a ratio of {ratio} needs 1 <= ratio <= G (G = {samples} samples)")
    prompt = int(round(samples * length * (1 - 1 / ratio) / (samples - 1)))
    prompt = min(max(prompt, 0), length - 1)
    rng = np.random.default_rng(seed)
    if prompt == 0:  # nothing shared: every sequence starts with its own token
        return distinct_starts(rng, vocab, [length] * groups * samples), 0
    seqs = []
    for p in distinct_starts(rng, vocab, [prompt] * groups):
        seqs += [np.concatenate([p, r]) for r in distinct_starts(rng, vocab, [length - prompt] * samples)]
    return seqs, prompt


@dataclass
class Row:
    sweep: str
    workload: str
    mode: str
    sequences: int
    flat_tokens: int
    tree_tokens: int
    ideal_ratio: float
    target_ratio: float | None = None
    prompt_len: int | None = None
    response_len: int | None = None
    chunk_tokens: int | None = None
    max_tokens: int | None = None
    seconds: float = float("nan")
    times: list[float] = field(default_factory=list)
    speedup: float = float("nan")  # flat seconds / seconds (sharing sweep)
    fraction_of_ideal: float = float("nan")
    useful_tflop: float = 0.0
    tflops: float | None = None
    pct_of_peak: float | None = None
    peak_gib: float | None = None
    calls: int = 0
    tokens_run: int = 0
    block_recompute_tokens: int = 0
    recomputed_tflop: float = 0.0
    peak_live_tokens: int = 0
    plan: str = ""
    same_plan_as: int | None = None
    error: str | None = None


class Sweeps:
    def __init__(self, args: argparse.Namespace, t0: float | None = None):
        self.args = args
        self.t0 = time.perf_counter() if t0 is None else t0  # --max-seconds counts from here
        self.device = torch.device(args.device)
        self.model = build_model(args.family, args.shape, dtype=args.dtype, device=self.device, seed=args.seed)
        self.model.train()
        for p in self.model.parameters():  # gradients allocated up front: every peak includes them
            p.grad = torch.zeros_like(p)
        self.vocab = self.model.get_input_embeddings().num_embeddings
        self.body, self.head = matmul_params(self.model)
        self.rows: list[Row] = []
        self.engines: dict = {}
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"

    # ------------------------------------------------------------------ helpers
    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def out_of_time(self) -> bool:
        return self.args.max_seconds is not None and time.perf_counter() - self.t0 > self.args.max_seconds

    def engine(self, mode: str, chunk: int | None = None) -> TreeEngine:
        """One engine per mode at default settings (its memory model measured once);
        ``auto-fixed``: auto with ``max_tokens`` = ``--auto-max-tokens``."""
        if mode not in self.engines:
            kw = dict(max_tokens=self.args.auto_max_tokens) if mode == "auto-fixed" else {}
            self.engines[mode] = TreeEngine(self.model, mode.split("-")[0], attention=self.args.attention, **kw)
        engine = self.engines[mode]
        engine.chunk_tokens = chunk if chunk is not None else self.args.chunk_tokens
        return engine

    def measure(self, row: Row, engine: TreeEngine, tree: PrefixTree) -> Row:
        plan = engine.plan(tree)
        row.max_tokens, row.chunk_tokens = engine.memory.max_tokens, engine.chunk_tokens
        row.peak_live_tokens = plan.peak_live_tokens()
        row.useful_tflop = useful_flops(self.model, tree) / 1e12
        if self.out_of_time():
            row.error = f"skipped: past --max-seconds {self.args.max_seconds:g}"
            return row
        loss_fn = weighted_logprob_loss(tree, self.args.seed)
        try:
            seconds, times, peak = time_forward_backward(engine, tree, loss_fn, self.args.repeats, self.args.warmup)
        except torch.OutOfMemoryError as exc:  # a result, not a crash
            row.error = f"out of memory: {str(exc).splitlines()[0][:80]}"
            self.model.zero_grad(set_to_none=False)
            torch.cuda.empty_cache()
            return row
        stats = engine.stats
        row.seconds, row.times, row.calls, row.tokens_run, row.plan = seconds, times, stats.model_calls, stats.tokens_run, stats.plan
        row.peak_gib = None if peak is None else peak / 2**30
        row.tflops = row.useful_tflop / seconds
        row.pct_of_peak = 100 * row.tflops / self.args.peak_tflops
        # every token run beyond the unique ones is a forward (no-grad pass or capture)
        row.block_recompute_tokens = sum(s.size for s in plan.segments if s.recompute)
        extra = max(0, row.tokens_run - tree.num_tree_tokens) if engine.mode != "flat" else 0
        row.recomputed_tflop = (extra * 2 * (self.body + self.head) + row.block_recompute_tokens * 2 * self.body) / 1e12
        return row

    def save(self) -> None:
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        cfg = {k: v for k, v in vars(self.args).items()}
        (out / "sweeps.json").write_text(json.dumps(
            {"config": cfg, "device": self.device_name, "torch": torch.__version__,
             "rows": [asdict(r) for r in self.rows]}, indent=1))

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.save()
        what = row.error or f"{row.seconds:.3f} s, {row.calls} calls" + (
            f", peak {row.peak_gib:.1f} GiB" if row.peak_gib is not None else "")
        self.log(f"{row.sweep} {row.workload} {row.mode} chunk={row.chunk_tokens}: {what}")

    # ------------------------------------------------------------------ sweeps
    def sharing(self) -> None:
        groups, samples, length = self.args.sharing_shape
        for ratio in self.args.ratios:
            seqs, prompt = sharing_sequences(ratio, groups, samples, length, self.vocab, self.args.seed)
            tree = PrefixTree.from_sequences(seqs)
            point = []
            for mode in self.args.sharing_modes:
                row = Row("sharing", f"r={ratio:g}", mode, tree.num_sequences, tree.num_flat_tokens,
                          tree.num_tree_tokens, tree.ideal_ratio, target_ratio=ratio, prompt_len=prompt,
                          response_len=length - prompt)
                point.append(self.measure(row, self.engine(mode), tree))
                self.add(row)
            flat = next((r for r in point if r.mode == "flat" and not r.error), None)
            for r in point:
                if flat is not None and not r.error:
                    r.speedup = flat.seconds / r.seconds
                    r.fraction_of_ideal = r.speedup / r.ideal_ratio
            self.save()

    def chunks(self) -> None:
        spec = dataclasses.replace(
            SCALES[self.args.scale],
            agent_groups=self.args.agentic_groups or max(1, SCALES[self.args.scale].agent_groups // 2),
            long_groups=self.args.long_groups or max(1, SCALES[self.args.scale].long_groups // 2),
        )
        for workload in self.args.chunk_workloads:
            tree = PrefixTree.from_sequences(make_workload(workload, spec, self.vocab, seed=self.args.seed))
            for mode in self.args.chunk_modes:
                last_segments, last_row = None, None
                for chunk in self.args.chunks:
                    engine = self.engine(mode, chunk)
                    segments = [(s.start, s.end, s.parent, s.retain) for s in engine.plan(tree).segments]
                    row = Row("chunks", workload, mode, tree.num_sequences, tree.num_flat_tokens,
                              tree.num_tree_tokens, tree.ideal_ratio)
                    if segments == last_segments and last_row is not None and not last_row.error:
                        row = dataclasses.replace(last_row, chunk_tokens=chunk, same_plan_as=last_row.chunk_tokens)
                    else:
                        self.measure(row, engine, tree)
                        last_row = row
                    last_segments = segments
                    self.add(row)

    # ------------------------------------------------------------------ report
    def tables(self) -> str:
        fmt = lambda x, f: "-" if x is None or x != x else format(x, f)  # noqa: E731
        out = []
        for sweep, head, cells in (
            ("sharing", ["target", "ideal", "P", "L-P", "mode", "s/step", "vs flat", "of ideal", "TFLOP/s", "% peak",
                         "peak GiB", "calls"],
             lambda r: [fmt(r.target_ratio, "g"), f"{r.ideal_ratio:.2f}", str(r.prompt_len), str(r.response_len),
                        r.mode, r.error or fmt(r.seconds, ".4f"), fmt(r.speedup, ".2f"),
                        fmt(r.fraction_of_ideal, ".2f"), fmt(r.tflops, ".3g"), fmt(r.pct_of_peak, ".3g"),
                        fmt(r.peak_gib, ".1f"), str(r.calls)]),
            ("chunks", ["workload", "mode", "chunk", "max tok", "s/step", "peak GiB", "live tok", "calls",
                        "recomp TFLOP", "of useful", "TFLOP/s", "% peak"],
             lambda r: [r.workload, r.mode, str(r.chunk_tokens), str(r.max_tokens),
                        (r.error or fmt(r.seconds, ".4f")) + ("*" if r.same_plan_as else ""), fmt(r.peak_gib, ".1f"),
                        str(r.peak_live_tokens), str(r.calls), fmt(r.recomputed_tflop, ".3g"),
                        fmt(r.recomputed_tflop / r.useful_tflop if r.useful_tflop else None, ".2f"),
                        fmt(r.tflops, ".3g"), fmt(r.pct_of_peak, ".3g")]),
        ):
            rows = [r for r in self.rows if r.sweep == sweep]
            if not rows:
                continue
            lines = [head] + [cells(r) for r in rows]
            widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
            text = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
            text.insert(1, "  ".join("-" * w for w in widths))
            out.append(f"\n{sweep}:\n" + "\n".join(text))
        if any(r.same_plan_as for r in self.rows):
            out.append("* the same plan as the previous chunk size: its measurement repeated")
        return "\n".join(out)

    def plots(self) -> list[Path]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out = Path(self.args.out)
        title = f"{self.args.family} {self.args.shape} {self.args.dtype}, {self.device_name}"
        written = []
        share = [r for r in self.rows if r.sweep == "sharing" and not r.error]
        if share:
            fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
            top = max(r.ideal_ratio for r in share)
            axes[0].plot([1, top], [1, top], "k--", lw=1, label="ideal")
            for mode in self.args.sharing_modes:
                pts = sorted((r.ideal_ratio, r.speedup, r.tflops) for r in share if r.mode == mode)
                if not pts:
                    continue
                x, speed, tflops = zip(*pts)
                axes[0].plot(x, speed, "o-", label=mode)
                axes[1].plot(x, tflops, "o-", label=mode)
            axes[0].set(xlabel="ideal ratio (flat / unique tokens)", ylabel="speed-up vs flat", title="speed-up")
            axes[1].set(xlabel="ideal ratio (flat / unique tokens)", ylabel="TFLOP/s on unique tokens",
                        title=f"throughput ({self.args.peak_tflops:g} = peak)")
            for ax in axes:
                ax.set_xscale("log", base=2)
                ax.grid(alpha=0.3)
                ax.legend()
            fig.suptitle(f"sharing sweep: {title}", fontsize=10)
            fig.tight_layout()
            fig.savefig(out / "sharing.png", dpi=120)
            plt.close(fig)
            written.append(out / "sharing.png")
        chunk_rows = [r for r in self.rows if r.sweep == "chunks" and not r.error]
        if chunk_rows:
            workloads = [w for w in self.args.chunk_workloads if any(r.workload == w for r in chunk_rows)]
            cuda = any(r.peak_gib is not None for r in chunk_rows)
            metrics = [("seconds", "s / step"),
                       ("peak_gib", "peak GiB") if cuda else ("peak_live_tokens", "peak live tokens (plan)"),
                       ("recomputed_tflop", "recomputed TFLOP")]
            fig, axes = plt.subplots(len(metrics), len(workloads), figsize=(5 * len(workloads), 3.2 * len(metrics)),
                                     squeeze=False)
            for j, workload in enumerate(workloads):
                for i, (key, label) in enumerate(metrics):
                    ax = axes[i][j]
                    for mode in self.args.chunk_modes:
                        pts = sorted((r.chunk_tokens, getattr(r, key)) for r in chunk_rows
                                     if r.workload == workload and r.mode == mode)
                        name = f"auto max_tokens={self.args.auto_max_tokens}" if mode == "auto-fixed" else mode
                        if pts:
                            ax.plot(*zip(*pts), "o-", label=name)
                    ax.set_xscale("log", base=2)
                    ax.set(xlabel="chunk_tokens", ylabel=label)
                    ax.grid(alpha=0.3)
                    if i == 0:
                        ax.set_title(workload)
                        ax.legend()
            fig.suptitle(f"chunk sweep: {title}", fontsize=10)
            fig.tight_layout()
            fig.savefig(out / "chunks.png", dpi=120)
            plt.close(fig)
            written.append(out / "chunks.png")
        return written


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--family", default="qwen3", choices=list(FAMILIES))
    p.add_argument("--shape", default="small", choices=list(SHAPES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--scale", default="small", choices=list(SCALES),
                   help="sizes: the sharing sweep's G x L, the chunk sweep's workloads and default chunks")
    p.add_argument("--out", type=Path, required=True, help="directory for sweeps.json and the PNG plots")
    p.add_argument("--sweeps", type=_names, default=("sharing", "chunks"), help="comma-separated: sharing,chunks")
    p.add_argument("--ratios", type=_floats, default=RATIOS, help="target ideal ratios of the sharing sweep")
    p.add_argument("--sharing-shape", type=_ints, default=None,
                   help="groups,G,L of the sharing sweep (default per scale: paper 1,32,1024)")
    p.add_argument("--sharing-modes", type=_names, default=SHARING_MODES)
    p.add_argument("--chunks", type=_ints, default=None, help="chunk sizes (default per scale: paper 512..8192)")
    p.add_argument("--chunk-modes", type=_names, default=CHUNK_MODES, help="dfs, auto, auto-fixed")
    p.add_argument("--auto-max-tokens", type=int, default=None,
                   help="max_tokens of auto-fixed (default per scale: paper 8192, small 256, tiny 16)")
    p.add_argument("--chunk-workloads", type=_names, default=CHUNK_WORKLOADS)
    p.add_argument("--agentic-groups", type=int, default=None, help="default: half the scale's")
    p.add_argument("--long-groups", type=int, default=None, help="default: half the scale's")
    p.add_argument("--chunk-tokens", type=int, default=2048, help="chunk_tokens of the sharing sweep")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flex"])
    p.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="skip the points that would start after this many seconds (recorded as skipped)")
    return p


def main(argv: list[str] | None = None) -> Sweeps:
    t0 = time.perf_counter()
    p = parser()
    args = p.parse_args(argv)
    args.sharing_shape = tuple(args.sharing_shape or SHARING_SHAPES[args.scale])
    if len(args.sharing_shape) != 3:
        p.error("--sharing-shape takes groups,G,L")
    args.chunks = tuple(args.chunks or CHUNKS[args.scale])
    args.auto_max_tokens = args.auto_max_tokens or AUTO_FIXED_TOKENS[args.scale]
    for name, given, known in (("sweep", args.sweeps, ("sharing", "chunks")),
                               ("sharing mode", args.sharing_modes, ("flat", "packed", "dfs", "auto")),
                               ("chunk mode", args.chunk_modes, CHUNK_MODES),
                               ("chunk workload", args.chunk_workloads, ("grpo", "agentic", "none", "long", "tree"))):
        bad = [x for x in given if x not in known]
        if bad:
            p.error(f"unknown {name} {', '.join(bad)}: choose from {', '.join(known)}")
    if "flat" not in args.sharing_modes:
        args.sharing_modes = ("flat",) + tuple(args.sharing_modes)  # the baseline, in the same run
    args.out = str(args.out)
    sweeps = Sweeps(args, t0)
    sweeps.log(f"{args.family} {args.shape} {args.dtype} on {sweeps.device_name}; sweeps {','.join(args.sweeps)}")
    if "sharing" in args.sweeps:
        sweeps.sharing()
    if "chunks" in args.sweeps:
        sweeps.chunks()
    sweeps.save()
    written = sweeps.plots()
    print(f"bench_sweeps: {args.family} {args.shape} {args.dtype} on {sweeps.device_name}, scale {args.scale}, "
          f"% of {args.peak_tflops:g} TFLOP/s; {time.perf_counter() - sweeps.t0:.0f} s")
    print(sweeps.tables())
    print("wrote", ", ".join(str(w) for w in [Path(args.out) / "sweeps.json", *written]))
    return sweeps


if __name__ == "__main__":
    main()
