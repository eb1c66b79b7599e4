"""A chain piece after a long prefix (issue 24): one layer's attention forward+backward.

    python bench/chain_attention.py --out results/chain_attention_h100.json    # H100, ~1-2 min
    python bench/chain_attention.py --smoke                                     # CPU, tiny sizes

The engine runs a long prompt as chain pieces of ~2,048 tokens, each attending to every
earlier token (its prefix) and to itself causally. Per prefix length (8k / 16k / 30,720 keys
before 2,048 queries; Qwen3-1.7B heads: 16 query / 8 KV of 128, bf16), forward+backward of:

- ``tree-flex``: today's path (``flex_tree_attention`` with the tree block mask);
- ``sdpa-lower-right``: SDPA with ``causal_lower_right`` (one flash call, mask aligned bottom-right);
- ``chain-<kernel>[-expanded]``: :mod:`treerl.engine.chain_attention` (full attention to the
  prefix + causal to its own keys, merged by their log-sum-exp) through each fused kernel,
  with the K/V heads as they are (GQA) or repeated to the query heads.

Per row: best-of-``--repeats`` ms and TFLOP/s (visible pairs x 12 x heads x head_dim: DESIGN.md's
forward+backward count), ``first_ms`` (the first call at that shape: cuDNN builds a graph per
new shape, flex compiles), and the max abs / relative error (to the largest value) of the
output and dQ, dK, dV against float32 math on the same bf16 inputs (TF32 off), next to bf16
rounding (~4e-3 relative).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from treerl.engine import chain_attention as chain
from treerl.engine.attention import flex_block_mask, flex_tree_attention


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernels(device, heads: int, kv_heads: int, nq: int, nk: int, scale: float) -> dict:
    """name -> attention(q, k, v) for one chain piece of ``nq`` queries after ``nk - nq`` keys."""
    from torch.nn.attention.bias import causal_lower_right

    prefix = nk - nq
    out = {}
    if device.type == "cuda":
        q_index, k_index = torch.arange(prefix, nk, device=device), torch.arange(nk, device=device)
        mask = flex_block_mask(q_index, k_index, torch.full_like(k_index, nk))
        out["tree-flex"] = lambda q, k, v: flex_tree_attention(q, k, v, mask, scale)
        bias = causal_lower_right(nq, nk)
        out["sdpa-lower-right"] = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
        names = chain.KERNELS
    else:
        names = ()
    for name in names:
        for expand in (False, True):
            kernel = chain.fused_kernel(name, expand)  # as the engine runs it (cuDNN's on its grid)
            out[f"chain-{name}{'-expanded' if expand else ''}"] = (
                lambda q, k, v, kernel=kernel: chain.ChainAttention.apply(q, k, v, prefix, scale, kernel))
    out["chain-math"] = lambda q, k, v: chain.ChainAttention.apply(q, k, v, prefix, scale, chain.MATH)
    return out


def errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict:
    row = {}
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        diff = float((a.float() - b).abs().max())
        row[f"{what}_abs"] = diff
        row[f"{what}_rel"] = diff / max(float(b.abs().max()), 1e-30)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: the script end to end")
    ap.add_argument("--prefixes", default="8192,16384,30720")
    ap.add_argument("--queries", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    heads, kv_heads, dim = (4, 2, 16) if args.smoke else (16, 8, 128)
    nq = 24 if args.smoke else args.queries
    prefixes = [40, 100] if args.smoke else [int(p) for p in args.prefixes.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference
    scale = dim ** -0.5
    results = dict(torch=torch.__version__, heads=heads, kv_heads=kv_heads, head_dim=dim, queries=nq, rows=[])
    if device.type == "cuda":
        results["device"] = torch.cuda.get_device_name(device)
        q0 = torch.zeros(1, heads, 8, dim, device=device, dtype=dtype)
        chosen = chain.kernel_for(q0, torch.zeros(1, kv_heads, 16, dim, device=device, dtype=dtype))
        results["engine_kernel"] = None if chosen is None else chosen.label
        results["probe"] = chain.PROBED
        print(f"{results['device']}, torch {torch.__version__}: the engine's chain kernel is "
              f"{results['engine_kernel']}", flush=True)
    for prefix in prefixes:
        nk = prefix + nq
        pairs = nq * prefix + nq * (nq + 1) / 2
        gen = torch.Generator().manual_seed(prefix)
        # the engine's layout: q a [1, H, N, D] view of [1, N, H, D]; K/V one [1, Hk, P + N, D]
        q = torch.randn(1, nq, heads, dim, generator=gen).transpose(1, 2).to(device, dtype).requires_grad_()
        k, v = (torch.randn(1, kv_heads, nk, dim, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))
        grad = torch.randn(1, nq, heads, dim, generator=gen).transpose(1, 2).to(device, dtype)
        with torch.no_grad():  # float32 math on the same inputs
            f32 = [x.detach().float() for x in (q, k, v, grad)]
            ref_out, ref_lse, ref_extras = chain.chain_forward(chain.MATH, *f32[:3], prefix, scale)
            reference = [ref_out, *chain.chain_backward(chain.MATH, f32[3], *f32[:3], ref_out, ref_lse, ref_extras,
                                                        prefix, scale)]
            del ref_lse, ref_extras
        for name, attend in kernels(device, heads, kv_heads, nq, nk, scale).items():
            if name == "chain-math" and device.type == "cuda":
                continue  # the reference itself
            row = dict(prefix=prefix, queries=nq, kernel=name)

            def step():
                out = attend(q, k, v)
                return [out, *torch.autograd.grad(out, (q, k, v), grad)]

            try:
                sync(device)
                t = time.perf_counter()
                got = step()
                sync(device)
                row["first_ms"] = 1e3 * (time.perf_counter() - t)
                row.update(errors([x.detach() for x in got], reference))
                del got
                best = float("inf")
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    step()
                    sync(device)
                    best = min(best, time.perf_counter() - t)
                row.update(ms=1e3 * best, tflops=pairs * 12 * heads * dim / best / 1e12)
            except Exception as exc:  # a kernel this device/torch lacks or refuses is a result
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(results, indent=1))
        del reference
    print_table(results)
    return results


def print_table(results: dict) -> None:
    print(f"\n| prefix | kernel | ms | TFLOP/s | first ms | out rel | dq rel | dk rel | dv rel |\n|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        if "error" in r:
            print(f"| {r['prefix']} | {r['kernel']} | {r['error'][:80]} | | | | | | |")
            continue
        print(f"| {r['prefix']} | {r['kernel']} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['first_ms']:.0f} | "
              f"{r['out_rel']:.1e} | {r['dq_rel']:.1e} | {r['dk_rel']:.1e} | {r['dv_rel']:.1e} |")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
