"""Tree attention kernels on the engine's masks (issue 11): does flex know its tiles?

Compiled with dynamic shapes, flex attention cannot prove a sequence length divides its
128-token tiles, so every tile pays bounds checks, index wrapping and extra masking
(``IS_DIVISIBLE=False``). The engine now pads each call to whole tiles and hands the
tile over as an axis of its own (:func:`treerl.engine.attention.flex_tree_attention`), which
keeps one compiled kernel for every length (results of 2026-11-24 were taken with the
padding inside the attention call; it now happens on the call's tokens). This script times, on the first ``--tokens``
tree tokens of each workload (Qwen3-1.7B heads: 16 query / 8 KV heads of 128, bf16), one
layer's attention forward and forward+backward for

- ``unknown-length``: ``torch.compile(flex_attention, dynamic=True)`` on the unpadded
  tensors (the engine before),
- ``tiles``: the engine's function,
- ``static``: ``torch.compile(flex_attention, dynamic=False)`` on the padded tensors
  (one kernel per length: the upper bound),

then, on one causal chain, the engine's flex against SDPA's flash and cuDNN kernels (cuDNN
with K/V expanded: it takes no GQA), cuDNN's first call on a new length (its per-shape plan),
and how many graphs the engine's function compiles over several lengths.

    python bench/attention_tiles.py --out results/attention_tiles_h100.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention
from triton.testing import do_bench

from treerl import PrefixTree
from treerl.engine.attention import FLEX_BLOCK, FLEX_KERNEL, flex_block_mask, flex_tree_attention
from treerl.devtools.workloads import SCALES, make_workload

H, HKV, D = 16, 8, 128


def qkv(n: int, dev):
    q = torch.randn(1, H, n, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, HKV, n, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, HKV, n, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    return q, k, v, torch.randn(1, H, n, D, device=dev, dtype=torch.bfloat16)


def timed(fn, grad):
    def step():
        fn().backward(grad)
    return do_bench(fn, return_mode="median"), do_bench(step, return_mode="median")


def row(**kw):
    print(json.dumps(kw), flush=True)
    return kw


def tree_masks(args, dev, rows):
    dynamic = torch.compile(flex_attention, dynamic=True)
    static = torch.compile(flex_attention, dynamic=False)
    for name in args.workloads.split(","):
        tree = PrefixTree.from_sequences(make_workload(name, SCALES["paper"], 151936))
        for n in map(int, args.tokens.split(",")):
            n = min(n, tree.num_tree_tokens)
            idx = torch.arange(n, device=dev)
            end = tree.subtree_end[:n].clamp(max=n).to(dev)
            mask = flex_block_mask(idx, idx, end)
            pairs = int((end - idx).sum())
            flops = 4 * H * D * pairs * 3.5
            q, k, v, g = qkv(n, dev)
            padded = lambda x: F.pad(x, (0, 0, 0, -n % FLEX_BLOCK))  # noqa: E731
            variants = {  # tiles: padded as the engine pads a call's tokens
                "tiles": lambda: flex_tree_attention(padded(q), padded(k), padded(v), mask, None)[:, :, :n],
                "static": lambda: static(padded(q), padded(k), padded(v), block_mask=mask, enable_gqa=True,
                                         kernel_options=FLEX_KERNEL)[:, :, :n],
            }
            if n % FLEX_BLOCK == 0:  # the mask's lengths are the tensors' own
                variants["unknown-length"] = lambda: dynamic(q, k, v, block_mask=mask, enable_gqa=True,
                                                             kernel_options=FLEX_KERNEL)
            ref = None
            for label, fn in variants.items():
                try:
                    out = fn().detach().float()
                    ref = out if ref is None else ref
                    fwd, total = timed(fn, g)
                    rows.append(row(part="tree", workload=name, tokens=n, variant=label, fwd_ms=fwd, fwd_bwd_ms=total,
                                    tflops=flops / total / 1e9, rel_err=float((out - ref).norm() / ref.norm())))
                except Exception as exc:  # a result, not a crash
                    rows.append(row(part="tree", workload=name, tokens=n, variant=label,
                                    error=f"{type(exc).__name__}: {str(exc)[:300]}"))


def causal(args, dev, rows):
    for n in map(int, args.causal.split(",")):
        q, k, v, g = qkv(n, dev)
        idx = torch.arange(n, device=dev)
        mask = flex_block_mask(idx, idx, torch.full((n,), n, device=dev))
        flops = n * (n + 1) / 2 * 4 * H * D * 3.5

        def sdpa(backend, expand):
            def fwd():
                kk, vv = (k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)) if expand else (k, v)
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)
            return fwd

        for label, fn in {"flex-tiles": lambda: flex_tree_attention(q, k, v, mask, None),
                          "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION, False),
                          "sdpa-cudnn-expanded": sdpa(SDPBackend.CUDNN_ATTENTION, True)}.items():
            try:
                fwd, total = timed(fn, g)
                rows.append(row(part="causal", tokens=n, variant=label, fwd_ms=fwd, fwd_bwd_ms=total,
                                tflops=flops / total / 1e9))
            except Exception as exc:
                rows.append(row(part="causal", tokens=n, variant=label, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    # cuDNN builds an execution plan per shape: the first call on a new length
    for n in (5000, 5100, 9000):
        q, k, v, g = qkv(n, dev)
        for label, backend, expand in (("sdpa-cudnn-expanded", SDPBackend.CUDNN_ATTENTION, True),
                                       ("sdpa-flash", SDPBackend.FLASH_ATTENTION, False)):
            try:
                torch.cuda.synchronize()
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    kk, vv = (k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)) if expand else (k, v)
                    with sdpa_kernel([backend]):
                        F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand).backward(g)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                rows.append(row(part="first-call", tokens=n, variant=label, first_s=times[0], later_s=times[1:]))
            except Exception as exc:
                rows.append(row(part="first-call", tokens=n, variant=label, error=f"{type(exc).__name__}: {str(exc)[:300]}"))


def recompiles(dev, rows):
    from torch._dynamo.utils import counters

    before = dict(counters["stats"])
    for n in (1000, 1500, 2222, 3000, 4567, 7000):
        q, k, v, g = qkv(n, dev)
        idx = torch.arange(n, device=dev)
        mask = flex_block_mask(idx, idx, torch.full((n,), n, device=dev))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pad = -n % FLEX_BLOCK
        flex_tree_attention(*(F.pad(x, (0, 0, 0, pad)) for x in (q, k, v)), mask, None)[:, :, :n].backward(g)
        torch.cuda.synchronize()
        rows.append(row(part="lengths", tokens=n, first_s=time.perf_counter() - t0,
                        unique_graphs=counters["stats"]["unique_graphs"] - before.get("unique_graphs", 0)))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="agentic,grpo,long,tree")
    ap.add_argument("--tokens", default="16384,16000")
    ap.add_argument("--causal", default="2048,4096,8192,16384")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows: list[dict] = []
    recompiles(dev, rows)
    tree_masks(args, dev, rows)
    causal(args, dev, rows)
    divisible = sorted({line.strip() for path in __import__("glob").glob("/tmp/torchinductor_*/**/*.py", recursive=True)
                        for line in open(path, errors="ignore") if "IS_DIVISIBLE : tl.constexpr" in line})
    rows.append(row(part="generated kernels", is_divisible=divisible))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
