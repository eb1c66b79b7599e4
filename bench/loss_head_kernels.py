"""The loss head's per-chunk elementwise kernels (issue 24): time and error of variants on one
chunk of logits as the engine makes it ([rows, vocab] bf16, rows = 2^27 / vocab), CUDA.

Session 23's tree profile had the head's compiled chunk kernels at ~0.95 ms a chunk (forward
0.29 ms, gradient 0.41 + 0.25 ms) where one read of a chunk's 268 MB takes ~0.06 ms at the
HBM's rate. Variants:

- forward ``inductor`` (``_chunk_forward`` compiled, as before session 23) and ``triton-BLOCKxWARPS``
  (:mod:`treerl.engine.head_kernel`: one pass per row, online log-sum-exp; main's is 4096 x 8);
- gradient ``scatter`` (the chunk gradient before session 23: ``scatter_add`` of the target's
  term, which makes inductor write a float32 buffer and convert it), ``inductor`` (``_chunk_grad_logits``
  compiled: the target's term by a column comparison, the entropy from the forward) and
  ``triton-BLOCKxWARPS`` (:mod:`treerl.engine.head_kernel`'s, main's 4096 x 8).

Each variant's results are compared with float64 on the same logits.

    python bench/loss_head_kernels.py --out results/
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from treerl.engine import head_kernel, loss_head


def grad_scatter(raw, targets, lse, grad_logprob, grad_entropy, inv_temperature: float):
    """The chunk gradient as it was before session 23 (scatter_add of the target's term)."""
    logits = raw.to(lse.dtype) * inv_temperature
    logp = logits - lse[:, None]
    probs = logp.exp()
    grad_logits = probs * (-grad_logprob[:, None])
    grad_logits = grad_logits.scatter_add(1, targets[:, None], grad_logprob[:, None])
    if grad_entropy is not None:
        ent = -(probs * logp).sum(-1, keepdim=True)
        grad_logits = grad_logits - grad_entropy[:, None] * probs * (logp + ent)
    return (grad_logits * inv_temperature).to(raw.dtype)


def reference(raw, targets, inv_temperature, g_lp, g_ent):
    x = raw.double() * inv_temperature
    lse = torch.logsumexp(x, -1)
    logp = x - lse[:, None]
    p = logp.exp()
    lp = logp.gather(1, targets[:, None])[:, 0]
    ent = -(p * logp).sum(-1)
    grad = -p * g_lp[:, None].double()
    grad.scatter_add_(1, targets[:, None], g_lp[:, None].double())
    if g_ent is not None:
        grad -= g_ent[:, None].double() * p * (logp + ent[:, None])
    return lse, lp, ent, grad * inv_temperature


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=0, help="rows of one chunk (0: the engine's default chunk)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = args.rows or (loss_head.DEFAULT_CHUNK_ELEMENTS // args.vocab)
    gen = torch.Generator(device=dev).manual_seed(0)
    raw = (torch.randn(rows, args.vocab, device=dev, generator=gen) * 3).to(torch.bfloat16)
    targets = torch.randint(0, args.vocab, (rows,), device=dev, generator=gen)
    g_lp = torch.randn(rows, device=dev, generator=gen)
    g_ent = torch.randn(rows, device=dev, generator=gen)
    inv = 1.0 / args.temperature
    ref = reference(raw, targets, inv, g_lp, g_ent)
    ref_noent = reference(raw, targets, inv, g_lp, None)
    chunk_bytes = raw.numel() * raw.element_size()
    results = dict(rows=rows, vocab=args.vocab, chunk_MB=chunk_bytes / 1e6, device=torch.cuda.get_device_name(),
                   forward={}, gradient={})

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=25, rep=200) * 1e3  # us

    def err(a, b):
        return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))

    forwards = {"inductor": loss_head._COMPILED[0]}
    for block, warps in ((4096, 8), (8192, 8), (8192, 4)):
        forwards[f"triton-{block}x{warps}"] = functools.partial(head_kernel.chunk_forward, block=block, warps=warps)
    for name, fn in forwards.items():
        for ent in (False, True):
            lse, lp, e = fn(raw, targets, inv, ent)
            row = dict(us=bench(lambda: fn(raw, targets, inv, ent)), lse_err=err(lse, ref[0]), lp_err=err(lp, ref[1]))
            if ent:
                row["ent_err"] = err(e, ref[2])
            row["TB_s"] = chunk_bytes / row["us"] / 1e6
            results["forward"][f"{name}{'+entropy' if ent else ''}"] = row
            print(f"forward {name:10s} entropy={ent!s:5s} {row['us']:8.1f} us  {row['TB_s']:.2f} TB/s  "
                  f"lse {row['lse_err']:.1e} logprob {row['lp_err']:.1e}", flush=True)
    lse, ent32 = ref[0].float(), ref[2].float()
    grads = {"scatter": lambda *a: scatter(*a[:-1]), "inductor": loss_head._COMPILED[1]}
    scatter = torch.compile(grad_scatter, dynamic=True)
    for block, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 8)):
        grads[f"triton-{block}x{warps}"] = functools.partial(head_kernel.chunk_grad_logits, block=block, warps=warps)
    for name, fn in grads.items():
        for ent in (False, True):
            ge = g_ent if ent else None
            out = fn(raw, targets, lse, g_lp, ge, inv, ent32)
            r = ref if ent else ref_noent
            row = dict(us=bench(lambda: fn(raw, targets, lse, g_lp, ge, inv, ent32)), grad_err=err(out, r[3]))
            row["TB_s"] = 2 * chunk_bytes / row["us"] / 1e6
            results["gradient"][f"{name}{'+entropy' if ent else ''}"] = row
            print(f"gradient {name:9s} entropy={ent!s:5s} {row['us']:8.1f} us  {row['TB_s']:.2f} TB/s (read+write)  "
                  f"grad {row['grad_err']:.1e}", flush=True)
    mm_h = 2048
    hidden = torch.randn(rows, mm_h, device=dev, dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(args.vocab, mm_h, device=dev, dtype=torch.bfloat16, generator=gen)
    results["logits_product_us"] = bench(lambda: hidden @ weight.t())
    print(f"logits product [{rows} x {mm_h}] @ [{mm_h} x {args.vocab}]: {results['logits_product_us']:.1f} us")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "loss_head_kernels.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
