"""The decode step's Q/K norm + RoPE + K/V write kernel (:func:`treerl.rollout.rope_kernel.rope_write`)
alone: microseconds a layer beside the time its bytes take at the HBM's rate.

Qwen3-0.6B / 1.7B heads (16 query, 8 KV heads of 128), bf16, rows of 8-sample groups, the token
written into a paged pool; timed as CUDA graph replays (``triton.testing.do_bench_cudagraph``).
Runs the kernel of whichever treerl is first on ``PYTHONPATH`` (an A/B: run it once per tree):

    PYTHONPATH=src python bench/rope_kernel.py --out $OUT/rope_new.json
    PYTHONPATH=.v/base/src python bench/rope_kernel.py --out $OUT/rope_base.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256,1024")
    p.add_argument("--bandwidth", type=float, default=4.277e12, help="HBM bytes/s (H200 4.28e12, H100 3.0e12)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    import triton

    import treerl
    from treerl.rollout.rope_kernel import rope_write

    heads, kv_heads, D, G, page = 16, 8, 128, 8, 64
    dt = torch.bfloat16
    norm = SimpleNamespace(weight=torch.rand(D, device="cuda", dtype=dt) + 0.5, variance_epsilon=1e-6)
    results = []
    for B in [int(r) for r in args.rows.split(",")]:
        qkv = torch.randn(B, 1, (heads + 2 * kv_heads) * D, device="cuda", dtype=dt)
        angle = torch.rand(B, 1, D, device="cuda")
        cos, sin = angle.cos().to(dt), angle.sin().to(dt)
        blocks = B * 8
        pools = [torch.zeros(blocks, kv_heads, page, D, device="cuda", dtype=dt) for _ in range(2)]
        block = torch.randperm(blocks, device="cuda")[:B]
        offset = torch.randint(0, page, (B,), device="cuda")
        run = lambda: rope_write(qkv, cos, sin, norm, norm, heads, kv_heads, G, *pools, block, offset)  # noqa: E731
        run()
        us = 1e3 * triton.testing.do_bench_cudagraph(run)
        moved = qkv.numel() * 2 + 2 * B * heads * D * 2 + 4 * B * kv_heads * D * 2  # read qkv; q twice, k/v twice
        row = dict(rows=B, us=round(us, 2), bytes=moved, floor_us=round(1e6 * moved / args.bandwidth, 2))
        results.append(row)
        print(row, flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(treerl=str(Path(treerl.__file__).parent), device=torch.cuda.get_device_name(),
                                            results=results), indent=1))


if __name__ == "__main__":
    main()
