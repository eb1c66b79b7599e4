"""Session 32's lead, measured alone before any engine change: the head's product and the sampling race in one kernel.

At 64 rows the decode step's head (cuBLAS, ~82 us for Qwen3's 311 MB of weights: bound by the weights' stream) is
followed by the race (``race_kernel``: ~47 us, bound by its ~106 instructions an element), launched after it. Here a
Triton product of ``x [M, K] @ W[V, K]^T`` (``M`` <= 128) writes the bf16 logits, as the head's product does, and in
its epilogue the race's per-(row, column tile) partials over exactly those logits: the running max and sum of
exponentials, the best race value ``x + g`` and its first column (``race_kernel``'s noise and pick helpers); then
``race_kernel._combine`` (unchanged) merges the tiles and reads the chosen logit back. The race's work then runs
beside the weights' stream instead of after it. Predicted at 64 rows: ~85-105 us against ~130 (+1.3..2.6% of a step).

Checks (every setting): the tokens equal ``race_reference``'s on the logits the kernel wrote, bit for bit (the same
per-element values; ties at the first column), its logprobs within 1e-5, and its logits within one bf16 unit of
cuBLAS's (another order of the float32 sums). Times: one CUDA-graph replay of each (``do_bench_cudagraph``), against
``torch.mm(out=)`` + ``race_kernel`` on the same weights.

    PYTHONPATH=src python bench/device/head_race_probe.py --out $OUT/head_race.json       # H200/H100
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/device/head_race_probe.py --smoke     # CPU: the checks only
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from treerl.rollout import race_kernel as rk
from treerl.rollout.sampling import draw_seeds, race_reference
from treerl.rollout.small_products import _tile, _tiles_of, _tma


@triton.jit
def _head_race_kernel(X, W, L, T, Seeds, PM, PS, PB, PI, M, V, K, sxm, swn, slm, st, NS,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """Program (column tile ``n``, row tile): ``L[rows, cols] = round(X @ W[cols]^T)`` and, per row, the race's
    partials over those columns at ``[row, n]`` (as ``race_kernel._partial`` keeps them for one range)."""
    n, mb = tl.program_id(0), tl.program_id(1)
    rm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = _tile(X, mb * BLOCK_M, M, sxm, k, BLOCK_M, BLOCK_K, TMA)
        w = _tile(W, n * BLOCK_N, V, swn, k, BLOCK_N, BLOCK_K, TMA)
        acc = tl.dot(x, tl.trans(w), acc)
    row_ok = rm < M
    col_ok = rn < V
    logit = acc.to(L.dtype.element_ty)
    tl.store(L + rm[:, None].to(tl.int64) * slm + rn[None, :], logit, mask=row_ok[:, None] & col_ok[None, :])
    t = tl.load(T + rm * st, mask=row_ok, other=1.0).to(tl.float32)
    greedy = t == 0.0
    inv = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    xs = tl.where(col_ok[None, :], logit.to(tl.float32) * inv[:, None], -float("inf"))
    m = tl.max(xs, 1)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    s = tl.sum(tl.exp(xs - m_safe[:, None]), 1)
    seed = tl.load(Seeds + rm, mask=row_ok, other=0).to(tl.uint64, bitcast=True)
    g = rk._noise_at(seed[:, None] + (rn[None, :] + 1).to(tl.uint64) * rk.GOLDEN)
    r = tl.where(col_ok[None, :], xs + tl.where(greedy[:, None], 0.0, g), -float("inf"))
    best = tl.max(r, 1)
    idx = tl.min(tl.where(r == best[:, None], rn[None, :], V), 1)  # (the first column of the best value)
    at = rm * NS + n
    tl.store(PM + at, m, mask=row_ok)
    tl.store(PS + at, s, mask=row_ok)
    tl.store(PB + at, best, mask=row_ok)
    tl.store(PI + at, idx, mask=row_ok)


def head_race(x: torch.Tensor, w: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, logits: torch.Tensor,
              tokens: torch.Tensor, logp: torch.Tensor, *, block_n: int = 128, block_k: int = 128, num_warps: int = 8,
              num_stages: int = 3) -> None:
    """``logits [M, V] = x [M, K] @ w[V, K]^T`` (``x``'s dtype) and the race's ``tokens``/``logp [M]`` over them
    (``temperature [M]`` or one value, ``seeds [M]`` int64), into the given outputs."""
    M, K = x.shape
    V = w.shape[0]
    block_m = 64 if M <= 64 else 128
    NS = triton.cdiv(V, block_n)
    part = torch.empty(3, M, NS, device=x.device, dtype=torch.float32)
    pidx = torch.empty(M, NS, device=x.device, dtype=torch.int32)
    st = 0 if temperature.numel() == 1 else temperature.stride(0)
    tma = _tma(x, w)
    _head_race_kernel[(NS, triton.cdiv(M, block_m))](
        *_tiles_of(x, w, block_m, block_n, block_k, tma), logits, temperature, seeds, part[0], part[1], part[2], pidx,
        M, V, K, x.stride(0), w.stride(0), logits.stride(0), st, NS,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, TMA=tma, num_warps=num_warps, num_stages=num_stages)
    rk._combine[(M,)](logits, temperature, part[0], part[1], part[2], pidx, tokens, logp, logits.stride(0), st, NS,
                      BLOCK_S=max(2, triton.next_power_of_2(NS)), num_warps=4)


def check(x, w, t, seeds, logits, tokens, logp, **kw) -> dict:
    """One setting's outputs against ``race_reference`` on its own logits and cuBLAS's logits."""
    head_race(x, w, t, seeds, logits, tokens, logp, **kw)
    want_tok, want_lp = race_reference(logits.float(), t, seeds)
    ref = (x.float() @ w.float().T).to(logits.dtype)
    one_unit = torch.finfo(logits.dtype).eps * ref.float().abs().max()
    return dict(tokens_equal=bool(torch.equal(tokens, want_tok)),
                logp_max_diff=float((logp - want_lp).abs().max()),
                logits_within_one_unit=bool((logits.float() - ref.float()).abs().max() <= one_unit))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="16,32,64,128")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1: the checks on a small head")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dev = "cpu" if args.smoke else "cuda"
    if args.smoke:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--smoke runs under TRITON_INTERPRET=1"
        args.rows, args.vocab, args.hidden = "5,70", 1000, 64
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16  # (the interpreter truncates bf16 casts)
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(args.vocab, args.hidden, device=dev, generator=g) / args.hidden ** 0.5).to(dtype)
    settings = [dict(block_n=n, num_warps=wp, num_stages=s) for n in (64, 128, 256) for wp in (4, 8) for s in (3, 4)]
    if args.smoke:
        settings = [dict(block_n=64, num_warps=4, num_stages=2), dict(block_n=128, num_warps=4, num_stages=2)]
    out = []
    for M in [int(r) for r in args.rows.split(",")]:
        x = (torch.randn(M, args.hidden, device=dev, generator=g) * 2).to(dtype)
        seeds = draw_seeds(M, g, torch.device(dev))
        t = torch.where(torch.arange(M, device=dev) % 4 == 0, 0.0, 1.0)  # (every fourth row greedy)
        logits = torch.empty(M, args.vocab, device=dev, dtype=dtype)
        tokens = torch.empty(M, device=dev, dtype=torch.int64)
        logp = torch.empty(M, device=dev, dtype=torch.float32)
        if dev == "cuda":
            def base():
                torch.mm(x, w.t(), out=logits)
                rk.race_kernel(logits, t, seeds, tokens, logp)
            us = 1e3 * triton.testing.do_bench_cudagraph(base)
            out.append(dict(rows=M, way="cublas+race_kernel", us=round(us, 2)))
            print(out[-1], flush=True)
        for kw in settings:
            try:
                row = dict(rows=M, way="head_race", **kw, **check(x, w, t, seeds, logits, tokens, logp, **kw))
                if dev == "cuda":
                    row["us"] = round(1e3 * triton.testing.do_bench_cudagraph(
                        lambda: head_race(x, w, t, seeds, logits, tokens, logp, **kw)), 2)  # noqa: B023
            except Exception as err:  # noqa: BLE001 - a setting that does not compile or fit: recorded
                row = dict(rows=M, way="head_race", **kw, error=f"{type(err).__name__}: {str(err)[:120]}")
            out.append(row)
            print(row, flush=True)
    if args.smoke:
        bad = [r for r in out if not (r.get("tokens_equal") and r.get("logp_max_diff", 1) <= 1e-5
                                      and r.get("logits_within_one_unit"))]
        assert not bad, bad
        print("smoke: every check passed")
    if args.out:
        args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                                            results=out), indent=1))


if __name__ == "__main__":
    main()
