"""Peak memory as a tree gets wider at fixed depth: one prompt, 1 -> 64 leaves.

Depth-first (`dfs`) keeps one root-to-leaf path alive, so its peak should stay flat;
`flat` and `packed` in one call grow with the leaves. On CUDA: torch.cuda.max_memory_allocated
above the resident weights and grads. On CPU: each point in a fresh process, peak RSS growth
during the step. Writes a table, JSON and a PNG plot.

    python bench/bench_memory.py --device cuda --shape qwen3-0.6b --dtype bfloat16
    python bench/bench_memory.py                       # CPU, tiny model, small tree
"""

import argparse
import json
import multiprocessing as mp
import resource
from pathlib import Path

import numpy as np
import torch

import treerl
from treerl.devtools.benchmark import weighted_logprob_loss
from treerl.models import build_model


def make_tree(width, prompt_len, leaf_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, prompt_len)
    return treerl.PrefixTree.from_sequences(
        [np.concatenate([prompt, rng.integers(0, vocab, leaf_len)]) for _ in range(width)]
    )


def measure(args, mode, width, model=None):
    """Peak bytes of one forward_backward above the memory held before it."""
    if model is None:
        model = build_model("qwen3", args.shape, dtype=args.dtype, device=args.device)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    tree = make_tree(width, args.prompt_len, args.leaf_len, model.config.vocab_size)
    engine = treerl.TreeEngine(model, mode, max_tokens=args.max_tokens if mode != "auto" else args.auto_tokens,
                               chunk_tokens=args.chunk_tokens)
    loss_fn = weighted_logprob_loss(tree)
    if args.device.startswith("cuda"):
        engine.forward_backward(tree, loss_fn, separable=True)  # warm-up (compile)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        engine.forward_backward(tree, loss_fn, separable=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, engine.stats.model_calls
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine.forward_backward(tree, loss_fn, separable=True)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024, engine.stats.model_calls


def _child(args, mode, width, queue):
    torch.set_num_threads(1)
    queue.put(measure(args, mode, width))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--leaf-len", type=int, default=128)
    p.add_argument("--widths", default="1,2,4,8,16,32,64")
    p.add_argument("--modes", default="flat,packed,dfs,auto")
    p.add_argument("--max-tokens", type=int, default=1 << 20, help="flat/packed: one call for the whole batch")
    p.add_argument("--auto-tokens", type=int, default=2048, help="auto's budget")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--out", type=Path, default=Path("runs/bench_memory"))
    args = p.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    modes = args.modes.split(",")
    cuda = args.device.startswith("cuda")
    model = None
    if cuda:
        model = build_model("qwen3", args.shape, dtype=args.dtype, device=args.device)
        for prm in model.parameters():
            prm.grad = torch.zeros_like(prm)
    results = {m: [] for m in modes}
    ctx = mp.get_context("spawn")
    for mode in modes:
        for width in widths:
            if cuda:
                try:
                    peak, calls = measure(args, mode, width, model)
                except torch.OutOfMemoryError:
                    peak, calls = float("nan"), 0
                    torch.cuda.empty_cache()
            else:
                queue = ctx.Queue()
                proc = ctx.Process(target=_child, args=(args, mode, width, queue))
                proc.start()
                peak, calls = queue.get()
                proc.join()
            results[mode].append(peak / 2**20)
            print(f"{mode:7} width {width:3}: peak {peak / 2**20:9.1f} MiB  ({calls} calls)", flush=True)
    where = torch.cuda.get_device_name() if cuda else "CPU (fresh process per point, RSS growth)"
    print(f"\npeak memory above resident weights+grads, MiB — {args.shape} {args.dtype} on {where}; "
          f"prompt {args.prompt_len}, leaves of {args.leaf_len} tokens")
    print("width   " + "".join(f"{m:>10}" for m in modes))
    for i, w in enumerate(widths):
        print(f"{w:5}   " + "".join(f"{results[m][i]:10.1f}" for m in modes))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps({"device": where, "widths": widths, "peak_mib": results,
                                                      "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in modes:
        ax.plot(widths, results[m], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("leaves under one prompt")
    ax.set_ylabel("peak memory above weights (MiB)")
    ax.set_title(f"{args.shape} {args.dtype}, {where.split(' (')[0]}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "memory.png", dpi=120)
    print(f"plot: {args.out / 'memory.png'}")


if __name__ == "__main__":
    main()
