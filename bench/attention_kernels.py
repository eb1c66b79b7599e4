"""Attention kernels on one causal sequence, forward + backward (issue 11: is there a
faster kernel than flex for tree attention on this GPU?).

Qwen3-1.7B attention shape (16 query heads, 8 KV heads, head_dim 128), bf16, one sequence
of N tokens, causal: flex attention (treerl's tree backend, causal block mask), SDPA's
flash kernel, SDPA's cuDNN kernel (K/V expanded to 16 heads: cuDNN takes no GQA here),
and the varlen flash op. TFLOP/s counts the causal pairs (N(N+1)/2) x 4 x heads x dim
forward and 2.5x that backward.

    python bench/attention_kernels.py --tokens 8192,16384 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    H, Hkv, D = 16, 8, 128
    rows = []
    for n in map(int, args.tokens.split(",")):
        q = torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, Hkv, n, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, Hkv, n, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16)
        mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, 1, 1, n, n, device="cuda")
        flops = n * (n + 1) / 2 * 4 * H * D * 3.5
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")

        def run(fwd):
            def go():
                out = fwd()
                torch.autograd.grad(out, (q, k, v), do)
            return go

        def sdpa(backend, expand=False):
            def fwd():
                kk, vv = (k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)) if expand else (k, v)
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)
            return fwd

        def varlen():
            from torch.nn.attention.varlen import varlen_attn
            qq, kk, vv = (x[0].transpose(0, 1) for x in (q, k, v))
            try:
                out = varlen_attn(qq, kk, vv, cu, cu, n, n, is_causal=True)
            except TypeError:
                out = varlen_attn(qq, kk, vv, cu, cu, n, n, window_size=(-1, 0), enable_gqa=True)
            return out

        variants = {
            "flex": lambda: flex(q, k, v, block_mask=mask, enable_gqa=True),
            "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa_cudnn_expanded": sdpa(SDPBackend.CUDNN_ATTENTION, expand=True),
            "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
            "varlen_flash": varlen,
        }
        for name, fwd in variants.items():
            try:
                s = timed(run(fwd))
                row = dict(tokens=n, kernel=name, seconds=s, tflops=flops / s / 1e12)
            except Exception as exc:  # a result, not a crash
                row = dict(tokens=n, kernel=name, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
