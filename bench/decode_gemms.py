"""The decode step's matrix products at small row counts, by how they are called (issue 25).

At 64 rows the decode step's four products per layer (Q/K/V, output, gate/up, down) read their
weights once and are latency-bound; the profile (bench/RESULTS.md, session 5) shows the output
and down products at 0.7-0.9 TB/s. This times each product of a model shape at given row
counts as ``F.linear(x, W)`` (cuBLAS's choice, the default), as ``(W @ x^T)^T`` (the weight as
the left operand: cuBLAS tiles its long side), with cuBLASLt preferred, and through inductor's
autotuned Triton templates (``max-autotune-no-cudagraphs``), each checked against the default.
Prints microseconds and the weight bytes' rate (TB/s).

    python bench/decode_gemms.py --shape qwen3-0.6b --rows 64,1024 --out gemms.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from treerl.models import make_config  # noqa: E402


def products(config) -> dict[str, tuple[int, int]]:
    """name -> (out features, in features) of one layer's decode products (fused as treerl runs them)."""
    h = config.hidden_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    i = config.intermediate_size
    return {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def time_us(fn, iters: int = 100) -> float:
    """Device microseconds per call: ``iters`` calls captured in one CUDA graph, replayed 5
    times (median). Timing eager calls in a loop measures the host's launch cost instead
    (~21 us a call on the H100 machine, more than any of these products: session 5's first run)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(times)[2]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--rows", default="64,1024")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    config = make_config("qwen3", args.shape)
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows_out = []
    compiled = torch.compile(lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False)
    for m in map(int, args.rows.split(",")):
        for name, (n, k) in products(config).items():
            x = torch.randn(m, k, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
            want = F.linear(x, w)
            ways = {
                "linear": lambda: F.linear(x, w),
                "weight-left": lambda: (w @ x.t()).t(),
                "autotuned": lambda: compiled(x, w),
            }
            row = dict(shape=args.shape, rows=m, product=name, out=n, inp=k, weight_mb=n * k * 2 / 1e6)
            for way, fn in ways.items():
                try:
                    err = (fn().float() - want.float()).abs().max().item()
                    us = time_us(fn)
                    row[way] = dict(us=round(us, 2), tbps=round(n * k * 2 / us / 1e6, 2), max_diff=err)
                except Exception as e:  # noqa: BLE001 - report and go on
                    row[way] = dict(error=f"{type(e).__name__}: {e}"[:200])
            try:
                torch.backends.cuda.preferred_blas_library("cublaslt")
                us = time_us(lambda: F.linear(x, w))
                row["cublaslt"] = dict(us=round(us, 2), tbps=round(n * k * 2 / us / 1e6, 2))
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows_out, indent=1))
    return rows_out


if __name__ == "__main__":
    main()
