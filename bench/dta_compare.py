"""treerl against the DTA authors' engine (issue 24): the six shapes, the same batches and
weights, in one process.

    scripts/get_dta.sh                                              # once: ./.dta (git-ignored)
    PYTHONPATH=src python bench/dta_compare.py --out bench/results/dta_compare_h100.json   # H100, ~6-7 min
    PYTHONPATH=src python bench/dta_compare.py --device cpu --model-shape tiny --dtype float32 \\
        --scale tiny --dta-block-size 8 --out /tmp/dta.json                               # CPU smoke, seconds

Engines: treerl ``auto`` and ``dfs`` (``TreeEngine(model, mode)``, defaults otherwise) and
``dta``: ``TreeTrainingEngine`` of github.com/Whisper-6/DynamicTreeAttn (commit 62d52d3, copied
into ``.dta/`` by ``scripts/get_dta.sh``) at the settings of the authors' ``run.py``: ``block_size``
2048, their "ours" traversal order (``TokenTrie.backward_permute``), ``cut_f1_tail=True``, its
log-prob head (``gather_logprobs_entropy``: compiled, 1,024-row chunks, entropy computed), K/V and
gradient buffers in the model dtype. One deviation: the authors run the Hugging Face model with
``attn_implementation="flash_attention_3"``, which is not installed here; the model runs its
default attention (SDPA; with a prefix cache Hugging Face passes SDPA an explicit causal mask).

Per shape (``treerl.devtools.workloads`` at ``--scale``: ``grpo``, ``agentic``, ``long``, ``tree``,
``long_prefix``, ``episodes``) and engine: seconds of one forward+backward of the same separable
token-sum loss (``treerl.devtools.benchmark.weighted_logprob_loss``: fixed random per-token weights;
the DTA engine calls it once per sequence with that sequence's index), the tree built inside every
timed step (treerl: ``PrefixTree.from_sequences``; DTA: ``TokenTrie`` + ``backward_permute``), the
median of up to ``--repeats`` steps after ``--warmup`` (fewer when a warm-up step took long:
``--row-seconds``); unique-token TFLOP/s (``useful_flops``) and its % of the warm bf16 matmul peak
measured in the same run (``bench/profile_engine.py``'s ``matmul_peak``, at the start and the end,
the larger used); ``max_memory_allocated`` over the timed steps, reset per engine (weights and
gradients included: gradients are allocated before any engine runs; the DTA engine's preallocated
buffers included). An out-of-memory or any failure of one engine on one shape is a row with
``error``, not a crash; rows not started after ``--max-seconds`` are recorded as skipped.

Gradient check (before the timings, ``--grad-batches``): parameter gradients of the DTA engine
against treerl ``auto`` on small batches, both in the model dtype, and both against a reference
(treerl ``auto`` with SDPA attention, uncompiled, on a float32 copy of the model; float64 on CPU).
``dta_ref_dtype`` runs DTA on the reference copy: it checks this harness (the same loss and
weights reach both engines), and should agree with the reference to float32 rounding (its
log-prob buffers are float32). Relative differences: global ``|a-b|/|b|`` over all parameters,
and per parameter (max, median, the worst parameter), as the authors' ``exp/compare_grads.py``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before torch touches CUDA

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_engine import matmul_peak  # noqa: E402

from treerl import PrefixTree, TreeEngine  # noqa: E402
from treerl.devtools.benchmark import useful_flops, weighted_logprob_loss  # noqa: E402
from treerl.engine import kernel_plans as plans  # noqa: E402
from treerl.devtools.workloads import SCALES, make_workload, prefix_fan  # noqa: E402
from treerl.models import SHAPES, build_model  # noqa: E402

DTA_DIR = ROOT / ".dta"
SHAPE_NAMES = ("grpo", "agentic", "long", "tree", "long_prefix", "episodes")
ENGINES = ("auto", "dfs", "dta")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


# ------------------------------------------------------------------------ the DTA engine
class DTAMissing(RuntimeError):
    pass


def load_dta(device: torch.device):
    """(TreeTrainingEngine, TokenTrie) from ``.dta/``. Off CUDA the log-prob head runs
    uncompiled (the authors compile it; Inductor on CPU only costs time here)."""
    if not (DTA_DIR / "tree_training_engine.py").is_file():
        raise DTAMissing(f"{DTA_DIR} has no DTA engine: run scripts/get_dta.sh first "
                         "(on a GPU machine: carry the .dta folder along)")
    if str(DTA_DIR) not in sys.path:
        sys.path.insert(0, str(DTA_DIR))
    import token_trie  # noqa: PLC0415 - the authors' top-level modules, from .dta/
    import tree_training_engine
    import vocab_parallel

    if device.type != "cuda":
        for name in ("_gather_logprobs", "_gather_logprobs_entropy"):
            fn = getattr(vocab_parallel, name)
            setattr(vocab_parallel, name, getattr(fn, "_torchdynamo_orig_callable", fn))
    return tree_training_engine.TreeTrainingEngine, token_trie.TokenTrie


# ------------------------------------------------------------------------ runners
class TreerlRunner:
    """One step: ``PrefixTree.from_sequences`` + ``TreeEngine.forward_backward`` (separable)."""

    def __init__(self, model, mode: str, **kwargs):
        self.engine = TreeEngine(model, mode, **kwargs)
        self.engine.memory.model  # the probe's allocations are not a step's
        self.settings = dict(mode=mode, **kwargs)

    def step(self, seqs, loss_fn) -> float:
        return self.engine.forward_backward(PrefixTree.from_sequences(seqs), loss_fn, separable=True)

    def describe(self) -> dict:
        s = self.engine.stats
        return dict(calls=s.model_calls, tokens_run=s.tokens_run, plan=s.plan)


class DTARunner:
    """One step: ``TokenTrie`` (sort, merge prefixes) + ``backward_permute`` +
    ``TreeTrainingEngine.backward`` at the authors' settings. ``loss_fn`` is treerl's
    separable loss, called per sequence with that sequence's index."""

    def __init__(self, model, seqs, block_size: int, dta):
        engine_cls, self.trie_cls = dta
        self.model, self.block_size = model, block_size
        dtype = next(model.parameters()).dtype
        device = model.get_output_embeddings().weight.device
        self.engine = engine_cls(model_config=model.config, device=device, dtype=dtype,
                                 max_seq_len=max(len(s) for s in seqs))
        self.settings = dict(block_size=block_size, permute="ours (backward_permute)", cut_f1_tail=True,
                             attn_implementation=model.config._attn_implementation,
                             buffers=str(dtype), commit="62d52d3")

    def step(self, seqs, loss_fn) -> float:
        def dta_loss(logprobs, entropy, attachment):  # the authors' loss signature, one sequence
            return loss_fn([logprobs], index=torch.tensor([attachment["_sequence_batch_id"]]))

        trie = self.trie_cls(seqs, [{} for _ in seqs])
        trie.backward_permute()
        return self.engine.backward(model=self.model, token_trie=trie, loss_fn=dta_loss,
                                    block_size=self.block_size, cut_f1_tail=True)

    def describe(self) -> dict:
        return {}


def make_runner(name: str, model, seqs, args, dta):
    if name == "dta":
        return DTARunner(model, seqs, args.dta_block_size, dta)
    return TreerlRunner(model, name, **({} if args.memory_budget is None else dict(memory_budget=args.memory_budget)))


def inputs_for(name: str, seqs):
    """The engine's input: numpy arrays for treerl, CPU LongTensors for DTA (as its data loads)."""
    return [torch.as_tensor(s, dtype=torch.long) for s in seqs] if name == "dta" else seqs


# ------------------------------------------------------------------------ helpers
def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(runner, seqs, loss_fn, model, device, args) -> dict:
    """Warm-up step(s), then up to ``repeats`` timed steps (fewer when a warm-up step took
    long), peak memory over the timed steps only. A warm-up step that deferred a new cuDNN shape for want
    of its call's allowance (``plans.CUDNN_NEW_SHAPES_PER_CALL``, ``call_deferred``) is followed
    by another, up to ``--warmup-max`` in all, so timed steps run every shape the way a long run does once
    it has met this tree's shapes."""
    warm = []
    more = isinstance(runner, TreerlRunner)  # (the DTA engine plans nothing through treerl's kernels)
    while len(warm) < args.warmup or (more and warm and len(warm) < args.warmup_max and plans.call_deferred()):
        t = time.perf_counter()
        runner.step(seqs, loss_fn)
        sync(device)
        warm.append(time.perf_counter() - t)
    model.zero_grad(set_to_none=False)
    last = warm[-1] if warm else float("inf")
    n = max(1, min(args.repeats, int(args.row_seconds // max(last, 1e-9))))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for _ in range(n):
        sync(device)
        t = time.perf_counter()
        loss = runner.step(seqs, loss_fn)
        sync(device)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    model.zero_grad(set_to_none=False)
    return dict(seconds=statistics.median(times), times=times, warmup_seconds=warm, loss=float(loss),
                peak_bytes=peak)


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_diff(a: dict, b: dict) -> dict:
    """|a-b|/|b| over all parameters (``global``) and per parameter (max, median, worst)."""
    num = den = 0.0
    per = {}
    for name, gb in b.items():
        ga, gb = a[name].double(), gb.double()
        d2, b2 = float(((ga - gb) ** 2).sum()), float((gb ** 2).sum())
        num, den = num + d2, den + b2
        if b2 > 0:
            per[name] = (d2 / b2) ** 0.5
    worst = max(per, key=per.get)
    return dict(global_rel=(num / den) ** 0.5, max_param_rel=per[worst], worst_param=worst,
                median_param_rel=statistics.median(per.values()))


def grad_batches(vocab: int, scale: str, block: int) -> dict:
    """Small batches: a branching tree (``tree`` at the small scale; tiny for a tiny run) and a
    prefix of 1.5 DTA blocks with 4 responses (its paths pop in blocks)."""
    small = "tiny" if scale == "tiny" else "small"
    return {
        f"tree@{small}": make_workload("tree", SCALES[small], vocab),
        f"prefix {3 * block // 2}+4": prefix_fan(3 * block // 2, 4, (max(1, block // 8), max(2, block // 4)), vocab),
    }


def grad_row(model, ref_model, seqs, args, dta, row: dict) -> None:
    """One batch of the gradient check into ``row`` (gradients held only in this call)."""
    tree = PrefixTree.from_sequences(seqs)
    loss_fn = weighted_logprob_loss(tree, args.seed)

    def live(m) -> dict:
        return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    for m in (model, ref_model):
        m.zero_grad(set_to_none=False)
    reference = TreeEngine(ref_model, "auto", attention="sdpa", compile=False)
    row["loss_ref"] = reference.forward_backward(tree, loss_fn, separable=True)
    g_ref = grads(ref_model)
    ref_model.zero_grad(set_to_none=False)
    row["loss_treerl"] = TreerlRunner(model, "auto").step(seqs, loss_fn)
    g_treerl = grads(model)
    model.zero_grad(set_to_none=False)
    row["treerl_vs_ref"] = rel_diff(g_treerl, g_ref)
    if dta is None:
        return
    row["loss_dta"] = DTARunner(model, seqs, args.dta_block_size, dta).step(inputs_for("dta", seqs), loss_fn)
    row["dta_vs_treerl"] = rel_diff(live(model), g_treerl)
    row["dta_vs_ref"] = rel_diff(live(model), g_ref)
    model.zero_grad(set_to_none=False)
    del g_treerl
    row["loss_dta_ref_dtype"] = DTARunner(ref_model, seqs, args.dta_block_size, dta).step(
        inputs_for("dta", seqs), loss_fn)
    row["dta_ref_dtype_vs_ref"] = rel_diff(live(ref_model), g_ref)


def grad_check(model, device, args, dta, results, save) -> None:
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    ref_model = copy.deepcopy(model).to(ref_dtype)
    vocab = model.get_input_embeddings().num_embeddings
    rows = results.setdefault("grad_check", [])
    for name, seqs in grad_batches(vocab, args.scale, args.dta_block_size).items():
        longest = max(len(s) for s in seqs)
        tree = PrefixTree.from_sequences(seqs)
        row = dict(batch=name, sequences=len(seqs), flat_tokens=tree.num_flat_tokens, tree_tokens=tree.num_tree_tokens,
                   longest=longest, dtype=str(next(model.parameters()).dtype),
                   reference=f"treerl auto, SDPA, uncompiled, {ref_dtype}")
        try:
            grad_row(model, ref_model, seqs, args, dta, row)
        except Exception as exc:  # a result, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
        for m in (model, ref_model):
            m.zero_grad(set_to_none=False)
        rows.append(row)
        print("grad_check", json.dumps(row), flush=True)
        save()
        free(device)
    del ref_model
    free(device)


# ------------------------------------------------------------------------ the run
def run(args) -> dict:
    t0 = time.perf_counter()
    device = torch.device(args.device)
    engines = [e for e in args.engines.split(",") if e]
    shapes = [s for s in args.shapes.split(",") if s]
    dta = load_dta(device) if "dta" in engines else None
    results: dict = dict(args=vars(args), torch=torch.__version__, rows=[])
    try:
        import transformers

        results["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - treerl needs it
        pass
    out = Path(args.out) if args.out else None

    def save() -> None:
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))

    peak = args.peak_tflops
    if device.type == "cuda":
        results["device"] = torch.cuda.get_device_name(device)
        if peak is None:
            peak = results["peak_tflops_start"] = matmul_peak(device)
        print(f"{results['device']}: bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    else:
        results["device"] = "CPU"
    model = build_model("qwen3", args.model_shape, dtype=DTYPES[args.dtype], device=device, seed=args.seed)
    model.train()
    for p in model.parameters():  # gradients allocated up front: every engine's peak includes them
        p.grad = torch.zeros_like(p)
    results.update(model=f"qwen3 {args.model_shape}", dtype=args.dtype,
                   attn_implementation=model.config._attn_implementation)
    if args.grad_check:
        grad_check(model, device, args, dta, results, save)
    vocab = model.get_input_embeddings().num_embeddings
    for shape in shapes:
        seqs = make_workload(shape, SCALES[args.scale], vocab, seed=args.seed)
        tree = PrefixTree.from_sequences(seqs)
        loss_fn = weighted_logprob_loss(tree, args.seed)
        flops = useful_flops(model, tree)
        info = dict(shape=shape, sequences=tree.num_sequences, flat_tokens=tree.num_flat_tokens,
                    tree_tokens=tree.num_tree_tokens, longest=int(tree.seq_lengths.max()),
                    ideal_ratio=tree.ideal_ratio, useful_tflop=flops / 1e12)
        print(f"\n{shape}: {tree.num_sequences} seqs, {tree.num_flat_tokens} flat / {tree.num_tree_tokens} tree "
              f"tokens, longest {info['longest']}", flush=True)
        for name in engines:
            row = dict(info, engine=name)
            if time.perf_counter() - t0 > args.max_seconds:
                row["error"] = f"skipped: --max-seconds {args.max_seconds:g} passed"
            else:
                runner = None
                try:
                    free(device)
                    sync(device)
                    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    runner = make_runner(name, model, seqs, args, dta)
                    row["settings"] = runner.settings
                    before = _compile_counts()
                    row.update(timed(runner, inputs_for(name, seqs), loss_fn, model, device, args))
                    row.update(runner.describe())
                    # (torch.compile's graphs and recompiles in this row: session 34 measured episodes 17% slower
                    # after five other shapes in one process than alone, with the same plan; bench/RESULTS.md)
                    row["compile"] = {k: v - before.get(k, 0) for k, v in _compile_counts().items()}
                    # (the process's cuDNN plans by then: a call's new shapes past its allowance take flash)
                    row["attention_shapes"] = {k: len(v) for k, v in plans.SHAPES.items()}
                    row["tflops"] = flops / row["seconds"] / 1e12
                    if row["peak_bytes"] is not None:
                        row["peak_gib"] = row["peak_bytes"] / 2**30
                        row["above_weights_gib"] = (row["peak_bytes"] - base) / 2**30
                except Exception as exc:  # out of memory or a failure: a result, not a crash
                    kind = "out of memory" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
                    row["error"] = f"{kind}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                    traceback.print_exc()
                del runner
                model.zero_grad(set_to_none=False)
                free(device)
            results["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("times", "settings")}), flush=True)
            save()
    if device.type == "cuda" and args.peak_tflops is None:
        results["peak_tflops_end"] = matmul_peak(device)
        peak = max(peak, results["peak_tflops_end"])
    results["peak_tflops"] = peak
    finish(results["rows"], peak)
    results["wall_s"] = time.perf_counter() - t0
    save()
    return results


def _compile_counts() -> dict[str, int]:
    """torch.compile's process-wide counters (dynamo's ``stats`` and ``recompiles``), flattened."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        return {}
    return {f"{group}.{k}": int(v) for group in ("stats", "recompiles", "graph_break")
            for k, v in counters.get(group, {}).items() if isinstance(v, (int, float))}


def finish(rows: list[dict], peak: float | None) -> None:
    """% of peak, DTA seconds / these seconds, peak memory / dfs's."""
    for row in rows:
        if "seconds" not in row:
            continue
        same = {r["engine"]: r for r in rows if r["shape"] == row["shape"] and "seconds" in r}
        if peak:
            row["pct_peak"] = 100 * row["tflops"] / peak
        if "dta" in same:
            row["speedup_vs_dta"] = same["dta"]["seconds"] / row["seconds"]
        if "dfs" in same and row.get("peak_bytes") and same["dfs"].get("peak_bytes"):
            row["memory_vs_dfs"] = row["peak_bytes"] / same["dfs"]["peak_bytes"]


def tables(results: dict) -> str:
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = [f"{results['device']}, {results['model']} {results['dtype']}, torch {results['torch']}, "
             f"transformers {results.get('transformers')}, attention of the DTA engine's model: "
             f"{results['attn_implementation']}, % of {fmt(results.get('peak_tflops'), '.0f')} TFLOP/s", "",
             "| shape | seqs | flat / tree tokens | longest | engine | s/step (n) | TFLOP/s | % peak | peak GiB "
             "| vs DTA (x) | memory vs dfs (x) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        head = f"| {r['shape']} | {r['sequences']} | {r['flat_tokens']} / {r['tree_tokens']} | {r['longest']} | {r['engine']} |"
        if "seconds" not in r:
            lines.append(f"{head} {r.get('error', '?')} | | | | | |")
            continue
        lines.append(f"{head} {r['seconds']:.3f} ({len(r['times'])}) | {r['tflops']:.3g} | "
                     f"{fmt(r.get('pct_peak'), '.1f')} | {fmt(r.get('peak_gib'), '.1f')} | "
                     f"{fmt(r.get('speedup_vs_dta'), '.2f')} | {fmt(r.get('memory_vs_dfs'), '.2f')} |")
    checks = results.get("grad_check", [])
    if checks:
        lines += ["", "Gradient check (relative difference of parameter gradients: global / max per parameter)", "",
                  "| batch | tokens (flat / tree, longest) | dta vs treerl | dta vs ref | treerl vs ref "
                  "| dta in ref dtype vs ref |", "|---|---|---|---|---|---|"]
        for c in checks:
            cell = lambda k: ("-" if k not in c else  # noqa: E731
                              f"{c[k]['global_rel']:.2e} / {c[k]['max_param_rel']:.2e}")
            lines.append(f"| {c['batch']} | {c['flat_tokens']} / {c['tree_tokens']}, {c['longest']} | "
                         f"{c.get('error') or cell('dta_vs_treerl')} | {cell('dta_vs_ref')} | "
                         f"{cell('treerl_vs_ref')} | {cell('dta_ref_dtype_vs_ref')} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model-shape", default="qwen3-1.7b", choices=list(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--scale", default="paper", choices=list(SCALES))
    p.add_argument("--shapes", default=",".join(SHAPE_NAMES), help=f"comma-separated: {','.join(SHAPE_NAMES)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated: {','.join(ENGINES)}")
    p.add_argument("--repeats", type=int, default=3, help="most timed steps per row, after the warm-up")
    p.add_argument("--row-seconds", type=float, default=10.0,
                   help="timed steps per row: at most this many seconds' worth (by the last warm-up step), at least 1")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--warmup-max", type=int, default=6,
                   help="warm-up steps at most while each defers new cuDNN shapes for want of its call's allowance")
    p.add_argument("--dta-block-size", type=int, default=2048, help="the DTA engine's block_size (its run.py default)")
    p.add_argument("--memory-budget", type=float, default=None,
                   help="treerl's memory budget, a fraction of the device (default: TreeEngine's); e.g. 0.141 on an "
                        "H200 (140.4 GiB) is an H100's default budget in bytes (25%% of 79.2 GiB)")
    p.add_argument("--grad-check", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--peak-tflops", type=float, default=None, help="skip measuring the matmul peak; use this")
    p.add_argument("--max-seconds", type=float, default=400.0, help="rows not started by then are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results (rewritten after every row)")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    for what, given, known in (("shape", args.shapes, SHAPE_NAMES), ("engine", args.engines, ENGINES)):
        items = [x for x in given.split(",") if x]
        bad = [x for x in items if x not in known]
        if bad or not items:
            p.error(f"unknown {what} {', '.join(bad) or '(none given)'}: choose from {', '.join(known)}")
    if args.repeats < 1 or args.warmup < 0 or args.warmup_max < args.warmup or args.dta_block_size < 1:
        p.error("--repeats and --dta-block-size must be at least 1, --warmup at least 0, --warmup-max at least --warmup")
    if args.memory_budget is not None and not 0 < args.memory_budget <= 1:
        p.error(f"--memory-budget is a fraction of the device in (0, 1], got {args.memory_budget:g}")
    try:
        results = run(args)
    except DTAMissing as exc:
        p.error(str(exc))
    print("\n" + tables(results))
    return results


if __name__ == "__main__":
    main()
