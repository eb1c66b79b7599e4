"""Flex attention kernel options on a real tree mask (issue 11): forward+backward time of
one layer's tree attention on whole tiles, as the engine calls it, (Qwen3-1.7B heads: 16 query / 8 KV heads of 128, bf16) under
several ``kernel_options`` sets, against SDPA's flash kernel on a causal mask of the same
length (what a dense causal document would cost).

    python bench/flex_options.py --workload agentic --out results/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention
from triton.testing import do_bench

from treerl import PrefixTree
from treerl.engine.attention import FLEX_BLOCK, FLEX_KERNEL, flex_block_mask, whole_tile_views
from treerl.devtools.workloads import SCALES, make_workload

OPTIONS = {  # on whole tiles (the engine's call); bwd_/fwd_ prefixes apply to one pass only
    "default": {},
    "tma": {"USE_TMA": True},
    "bwd-stages2": {"bwd_num_stages": 2},
    "bwd-stages4": {"bwd_num_stages": 4},
    "bwd-warps4": {"bwd_num_warps": 4},
    "bwd64x64": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64},
    "bwd32x128": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32},
    "fwd-stages4": {"fwd_num_stages": 4},
}


def tiles_call(opts: dict):
    """The engine's whole-tile flex call (treerl.engine.attention.flex_tree_attention) with extra
    kernel options; q/k/v [1, H, N, D] with N a multiple of FLEX_BLOCK."""
    def whole_tiles(query, key, value, block_mask):
        q, k, v = (x.flatten(2, 3) for x in (query, key, value))
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options={**FLEX_KERNEL, **opts})

    compiled = torch.compile(whole_tiles, dynamic=True)

    def call(q, k, v, mask):
        return compiled(*whole_tile_views(q, k, v), mask)
    return call


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="agentic")
    ap.add_argument("--max-tokens", type=int, default=16384, help="first segment of this many tree tokens")
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    seqs = make_workload(args.workload, SCALES["paper"], 151936)
    tree = PrefixTree.from_sequences(seqs)
    n = min(args.max_tokens, tree.num_tree_tokens) // FLEX_BLOCK * FLEX_BLOCK  # whole tiles
    idx = torch.arange(n, device=dev)
    end = tree.subtree_end[:n].clamp(max=n).to(dev)
    mask = flex_block_mask(idx, idx, end)
    pairs = int(((end - idx)).sum())  # visible (query, key) pairs of the segment
    print(f"{args.workload}: {n} tokens, {pairs / n:.0f} visible keys per query, block density "
          f"{mask.sparsity():.1f}% sparse", flush=True)
    q = torch.randn(1, 16, n, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, n, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, n, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, 16, n, 128, device=dev, dtype=torch.bfloat16)
    flops = 4 * 16 * 128 * pairs * 3.5  # forward 4*H*D per pair, backward ~2.5x forward
    rows = []

    def time_it(fn):
        def step():
            out = fn()
            out.backward(g)
        fwd = do_bench(lambda: fn(), return_mode="median")
        total = do_bench(step, return_mode="median")
        return fwd, total

    ref = None
    for name in args.options.split(","):
        try:
            call = tiles_call(OPTIONS[name])

            def fn():
                return call(q, k, v, mask)

            out = fn()
            if ref is None:
                ref = out.detach().float()
            err = float((out.detach().float() - ref).norm() / ref.norm())
            fwd, total = time_it(fn)
            rows.append(dict(option=name, fwd_ms=fwd, fwd_bwd_ms=total, tflops=flops / total / 1e9, rel_err=err))
        except Exception as exc:
            rows.append(dict(option=name, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"))
        print(json.dumps(rows[-1]), flush=True)
    # reference: flash attention on a causal mask of the same length (more pairs: n^2/2)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fwd, total = time_it(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True))
        causal_flops = 4 * 16 * 128 * (n * (n + 1) / 2) * 3.5
        rows.append(dict(option="sdpa-flash-causal (n^2/2 pairs)", fwd_ms=fwd, fwd_bwd_ms=total,
                         tflops=causal_flops / total / 1e9))
    except Exception as exc:
        rows.append(dict(option="sdpa-flash-causal", error=str(exc).splitlines()[0][:150]))
    print(json.dumps(rows[-1]))
    try:
        import inspect

        from torch.nn.attention import varlen
        print("varlen_attn", inspect.signature(varlen.varlen_attn))
    except Exception as exc:
        print("no varlen_attn:", exc)
    print("\n| option | fwd ms | fwd+bwd ms | TFLOP/s | rel err vs default |\n|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['option']} | {r['error']} |")
        else:
            print(f"| {r['option']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {r['tflops']:.0f} | {r.get('rel_err', 0):.1e} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"flex_options_tiles_{args.workload}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
