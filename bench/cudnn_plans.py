"""What a new cuDNN shape costs (issue 24: `kernel_plans.CUDNN_NEW_SHAPES_PER_CALL`, `CUDNN_MAX_SHAPES`).

    PYTHONPATH=src python bench/cudnn_plans.py --out bench/results/cudnn_plans.json    # GPU, ~1 min
    PYTHONPATH=src python bench/cudnn_plans.py --smoke                                 # CPU: the script end to end

One chain piece's attention forward+backward through :mod:`treerl.engine.chain_attention` with the
cuDNN kernel (Qwen3-1.7B heads: 16 query / 8 KV of 128, bf16) at ``--shapes`` distinct (queries,
prefix keys) shapes on the 128-token grid, each called twice: per shape the first call's ms (cuDNN
builds its forward and backward plans), the second's (planned), and the process's resident host
memory and the device's reserved memory after it (torch keeps every plan). Reports the median plan
cost (first - second) and the host memory per planned shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from treerl.engine import chain_attention as chain


def rss_mib() -> float:
    """This process's resident set (MiB), from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", type=int, default=48)
    ap.add_argument("--smoke", action="store_true", help="CPU: the math kernel, 3 tiny shapes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float64 if args.smoke else torch.bfloat16
    heads, kv_heads, dim = (4, 2, 16) if args.smoke else (16, 8, 128)
    kernel = chain.MATH if args.smoke else chain.select(device, dtype, heads, kv_heads, dim, names=("cudnn",))
    if kernel is None:
        raise SystemExit(f"cuDNN's kernel did not pass the probe: {chain.PROBED}")
    grid = 8 if args.smoke else 128
    count = 3 if args.smoke else args.shapes
    # queries 1,024-2,944 and prefixes 4k-28k on the grid, every pair new (the engine's chain pieces and groups)
    shapes = [(grid * (8 + i % 16), grid * (32 + 7 * i)) for i in range(count)]
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for n, prefix in shapes:
        q = torch.randn(1, heads, n, dim, generator=gen, dtype=torch.float32).to(device, dtype).requires_grad_()
        k = torch.randn(1, kv_heads, prefix + n, dim, generator=gen, dtype=torch.float32).to(device, dtype)
        v = torch.randn_like(k)
        k.requires_grad_(), v.requires_grad_()
        ms = []
        for _ in range(2):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = chain.ChainAttention.apply(q, k, v, prefix, dim**-0.5, kernel)
            out.sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            ms.append(1e3 * (time.perf_counter() - t))
        reserved = torch.cuda.memory_reserved() / 2**20 if device.type == "cuda" else 0.0
        rows.append(dict(queries=n, prefix=prefix, first_ms=ms[0], second_ms=ms[1], rss_mib=rss_mib(),
                         reserved_mib=reserved))
        print(json.dumps(rows[-1]), flush=True)
        del q, k, v, out
    plan_ms = [r["first_ms"] - r["second_ms"] for r in rows[1:]]  # (the first shape also pays the process's start)
    rss = [r["rss_mib"] for r in rows]
    summary = dict(shapes=len(rows), plan_ms_median=statistics.median(plan_ms), plan_ms_max=max(plan_ms),
                   rss_mib_per_shape=(rss[-1] - rss[1]) / max(1, len(rss) - 2), kernel=kernel.label,
                   device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__)
    print("summary", json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(summary=summary, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
