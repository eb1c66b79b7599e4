"""Session 30: the sampling race's per-element cost, variants timed beside the kernel (H200, CUDA graphs).

The race's loop issues ~106 instructions an element (sm_90 SASS, compiled on the CPU): two libdevice logs
(-log(-log u)) ~45, the splitmix64 hash ~32, the online softmax and race ~25. Variants of ``_partial``:
``OUT``/``IN``: the outer/inner log through MUFU (``fast_logf``: absolute error ~2^-21 near 1, so the inner
log, -log u for u near 1, loses its relative accuracy: timed only to bound the cost); ``PAIR``: one hash a pair of
columns (bits 63..41 and 40..18; columns j and j + 1,024 of each 2,048-column block). Each is checked against
the current kernel: tokens equal (rows x seeds), and the noise's largest difference. (Since the review after
session 30 the hash and the loop's update are race_kernel's own helpers, the same operations as the copies that ran.)
"""
import sys
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.testing import do_bench_cudagraph

from treerl.rollout import race_kernel as rk
from treerl.rollout.sampling import draw_seeds


@triton.jit
def _splitmix(seed, i):  # splitmix64 of (seed, index i), as race_kernel's loop hashes column i
    return rk._splitmix_rounds(seed + (i + 1).to(tl.uint64) * rk.GOLDEN)


@triton.jit
def _log(x, FAST: tl.constexpr):
    if FAST:
        return libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit
def _g(bits, IN: tl.constexpr, OUT: tl.constexpr):
    u = (bits.to(tl.float32) * 2.0 + 1.0) * 5.9604644775390625e-08
    return -_log(-_log(u, IN), OUT)


@triton.jit
def _upd(x, g, cols, valid, greedy, m, s, best, bidx):  # the kernel's loop body (race_kernel's helpers)
    m, s = rk._lse_step(x, m, s)
    best, bidx = rk._race_pick(x, g, cols, valid, greedy, best, bidx)
    return m, s, best, bidx


@triton.jit
def _partial2(L, T, Seeds, PM, PS, PB, PI, V, sl, st, per_split, NS, BLOCK: tl.constexpr,
              IN: tl.constexpr, OUT: tl.constexpr, PAIR: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.program_id(1)
    t = tl.load(T + row * st).to(tl.float32)
    greedy = t == 0.0
    inv = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    seed = tl.load(Seeds + row).to(tl.uint64, bitcast=True)
    start = sp * per_split
    end = tl.minimum(start + per_split, V)
    HALF: tl.constexpr = BLOCK // 2
    m = tl.full([HALF], -float("inf"), tl.float32)
    s = tl.zeros([HALF], tl.float32)
    best = tl.full([HALF], -float("inf"), tl.float32)
    bidx = tl.zeros([HALF], tl.int32) + start
    for off in range(start, end, BLOCK):
        ca = off + tl.arange(0, HALF)
        cb = ca + HALF
        va = ca < end
        vb = cb < end
        xa = tl.load(L + row.to(tl.int64) * sl + ca, mask=va, other=-float("inf")).to(tl.float32) * inv
        xb = tl.load(L + row.to(tl.int64) * sl + cb, mask=vb, other=-float("inf")).to(tl.float32) * inv
        if PAIR:
            h = _splitmix(seed, off // 2 + tl.arange(0, HALF))
            ga = _g(h >> 41, IN, OUT)
            gb = _g((h >> 18) & 0x7FFFFF, IN, OUT)
        else:
            ga = _g(_splitmix(seed, ca) >> 41, IN, OUT)
            gb = _g(_splitmix(seed, cb) >> 41, IN, OUT)
        m, s, best, bidx = _upd(xa, ga, ca, va, greedy, m, s, best, bidx)
        m, s, best, bidx = _upd(xb, gb, cb, vb, greedy, m, s, best, bidx)
    m_all = tl.max(m, 0)
    m_all_safe = tl.where(m_all == -float("inf"), 0.0, m_all)
    s_all = tl.sum(s * tl.exp(m - m_all_safe), 0)
    b_all = tl.max(best, 0)
    i_all = tl.min(tl.where(best == b_all, bidx, end), 0)
    at = row * NS + sp
    tl.store(PM + at, m_all)
    tl.store(PS + at, s_all)
    tl.store(PB + at, b_all)
    tl.store(PI + at, i_all)


def variant(logits, temperature, seeds, IN, OUT, PAIR):
    B, V = logits.shape
    splits = max(1, min(rk.MAX_SPLITS, -(-rk.TARGET_PROGRAMS // B), -(-V // rk.BLOCK)))
    per = -(-(-(-V // splits)) // rk.BLOCK) * rk.BLOCK
    NS = -(-V // per)
    part = torch.empty(3, B, NS, device=logits.device)
    pidx = torch.empty(B, NS, device=logits.device, dtype=torch.int32)
    tok = torch.empty(B, device=logits.device, dtype=torch.int64)
    lp = torch.empty(B, device=logits.device)
    _partial2[(B, NS)](logits, temperature, seeds, part[0], part[1], part[2], pidx, V, logits.stride(0), 0, per, NS,
                       BLOCK=rk.BLOCK, IN=IN, OUT=OUT, PAIR=PAIR, num_warps=8)
    rk._combine[(B,)](logits, temperature, part[0], part[1], part[2], pidx, tok, lp, logits.stride(0), 0, NS,
                      BLOCK_S=max(2, triton.next_power_of_2(NS)), num_warps=1)
    return tok, lp


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    t1 = torch.ones(1, device="cuda")
    for rows in (64, 1024):
        logits = (torch.randn(rows, 151_936, device="cuda", generator=g) * 4).bfloat16()
        seeds = draw_seeds(rows, g, logits.device)
        want_tok, want_lp = rk.race_kernel(logits, t1, seeds)
        base_us = do_bench_cudagraph(lambda: rk.race_kernel(logits, t1, seeds), rep=200) * 1e3
        print(f"rows {rows}: race_kernel {base_us:.1f} us", flush=True)
        for IN, OUT, PAIR in ((0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 1)):
            tok, lp = variant(logits, t1, seeds, IN, OUT, PAIR)
            us = do_bench_cudagraph(lambda: variant(logits, t1, seeds, IN, OUT, PAIR), rep=200) * 1e3
            # agreement over 20 seed draws (PAIR changes the noise itself: only the unpaired ones should agree)
            same = 0
            for k in range(20):
                s2 = draw_seeds(rows, g, logits.device)
                same += int((variant(logits, t1, s2, IN, OUT, PAIR)[0] == rk.race_kernel(logits, t1, s2)[0]).sum())
            print(f"rows {rows}: IN={IN} OUT={OUT} PAIR={PAIR}: {us:.1f} us ({us / base_us:.2f}x), tokens equal "
                  f"{same} of {20 * rows}, logp max diff {float((lp - want_lp).abs().max()):.2e}", flush=True)


if __name__ == "__main__":
    main()
