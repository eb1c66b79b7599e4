"""The untruncated sampling race in two Triton kernels: one pass over the logits.

:func:`~treerl.rollout.sampling.race_sample` (temperature, greedy rows, the behaviour
logprob) in plain torch is ~8 kernels over ``[B, V]`` (scale, log-softmax, noise, race,
gather; each pass over 64 rows x 152k float32 logits moves ~40-80 MB), launched from the
host after every decode step. Here:

1. ``_partial`` — programs ``(row, split)`` over column ranges of ``V``: each reads its
   logits once, scales them by the row's temperature, keeps the running max and sum of
   exponentials (the row's log-sum-exp) and the best race value ``x_j + g_j`` and its column,
   where ``g_j = -log E_j`` and ``E_j`` is the row's Exp(1) noise generated in the kernel from
   the row's seed (:func:`~treerl.rollout.sampling.race_noise`: splitmix64 of (seed, column),
   the same bits as the torch reference); greedy rows (temperature 0) race without noise.
   Each lane of the block keeps its own running values, reduced across lanes once at the
   end (no reduction, and no barrier, per block). The loop is bound by its instructions
   (81 an element on sm_90, ``bench/kernel_sass.py``): its logs and exps skip the special
   cases that the noise and the running sums never meet, with the same bits (session 33);
2. ``_combine`` — one program per row: merges the splits (first column wins ties, as
   ``argmax``), and writes the token and its logprob ``x_tok - lse``.

``logits [B, V]`` (float32/bfloat16/float16, last dim contiguous), ``temperature`` ``[B]`` or
one value (stride 0), ``row_seeds [B]`` int64 -> ``tokens [B]`` int64, ``logp [B]`` float32
(or into given outputs). Checked against the torch reference before its first use
(:func:`treerl.rollout.sampling.race_sample`).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only torch has no triton
    triton = None

BLOCK = 2048  # columns per loop step of a program
TARGET_PROGRAMS = 528  # ~4 per SM of an H100: splits of V per row are chosen to reach it
MAX_SPLITS = 64
NUM_WARPS = 8  # warps a ``_partial`` program (read at each call: benchmarks patch it)

if triton is not None:
    GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)  # splitmix64's increment
    _FTZ = not triton.knobs.runtime.interpret  # (the flushing exp's PTX: not under Triton's interpreter, read as it is)

    @triton.jit
    def _splitmix_rounds(h):
        """splitmix64's mixing rounds of its state ``h`` (uint64: the seed plus ``GOLDEN`` times the index + 1)."""
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB
        return h ^ (h >> 31)

    @triton.jit
    def _log_normal(a):
        """``log a`` (float32) for normal, positive, finite ``a``: libdevice's ``__nv_logf`` (what ``tl.log`` calls;
        the same operations and float32 constants in the same order, so the same bits) without its selects and
        branch for zero, subnormal, negative, infinite and NaN inputs (saves ~5 of its ~20 sm_90 instructions, session
        33). No intermediate is subnormal for such ``a`` (``f = m - 1`` is 0 or at least 2^-24 in magnitude), so
        its fused products' flush-to-zero does not matter."""
        ai = a.to(tl.int32, bitcast=True)
        e = (ai - 0x3F2AAAAB) & -8388608  # the exponent that puts the mantissa m in [2/3, 4/3)
        f = (ai - e).to(tl.float32, bitcast=True) - 1.0
        i = e.to(tl.float32) * 1.1920928955078125e-07  # 2^-23: e's exponent, exact
        r = tl.fma(f, -0.13018856942653656, 0.14084610342979431)  # 0xBE055027, 0x3E1039F6
        r = tl.fma(r, f, -0.12148627638816833)  # 0xBDF8CDCC
        r = tl.fma(r, f, 0.13980610668659210)  # 0x3E0F2955
        r = tl.fma(r, f, -0.16684235632419586)  # 0xBE2AD8B9
        r = tl.fma(r, f, 0.20012299716472626)  # 0x3E4CED0B
        r = tl.fma(r, f, -0.24999669194221497)  # 0xBE7FFF22
        r = tl.fma(r, f, 0.33333182334899902)  # 0x3EAAAA78
        r = tl.fma(r, f, -0.5)
        r = tl.fma(f * r, f, f)
        return tl.fma(i, 0.69314718246459961, r)  # ln 2 (0x3F317218)

    @triton.jit
    def _gumbel_of_hash(h):
        """The race's noise ``-log E`` from a column's splitmix64 hash ``h``: its top 23 bits ``b`` -> ``u = (2b +
        1) / 2^24`` (exact in float32, in [2^-24, 1)), ``E = -log u`` (in [6e-8, 16.7]); both logs of normal
        positive values (:func:`_log_normal`)."""
        u = ((h >> 40) | 1).to(tl.uint32).to(tl.float32) * 5.9604644775390625e-08  # (2b + 1) 2^-24
        return -_log_normal(-_log_normal(u))

    @triton.jit
    def _exp(x, FTZ: tl.constexpr):
        """``exp x`` as ``tl.exp`` computes it (``ex2.approx`` of ``x log2 e``), with ``FTZ`` through the flushing
        instruction (subnormal results 0; ``tl.exp``'s non-flushing ``ex2.approx.f32`` costs 3 instructions more
        on sm_90); without ``FTZ`` (Triton's interpreter, which runs no PTX) ``tl.exp`` itself."""
        if FTZ:
            return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * 1.4426950408889634],
                                             dtype=tl.float32, is_pure=True, pack=1)
        else:
            return tl.exp(x)

    @triton.jit
    def _noise_at(state):
        """The race's noise ``-log E`` (float32) for a column ``j`` of a row with seed ``seed`` (uint64) from its
        splitmix64 state ``state = seed + GOLDEN (j + 1)`` (uint64, wrapping): splitmix64's rounds, the hash's top 23
        bits ``b`` -> ``u = (2b + 1) / 2^24``, ``E = -log u``, the bits of
        :func:`treerl.rollout.sampling.race_noise`. ``_partial``'s loop adds a block's ``seed + GOLDEN (off + 1)`` to
        its lanes' ``GOLDEN j`` (one 64-bit product a block, not one a column)."""
        return _gumbel_of_hash(_splitmix_rounds(state))

    @triton.jit
    def _lse_step(x, m, s, FTZ: tl.constexpr = False):
        """One block of a lane's columns: the running max ``m`` and sum of exponentials ``s`` of the scaled
        logits ``x``. Returns ``(m, s)``. ``FTZ`` (:func:`_exp`) gives the same bits: once a lane has seen a
        finite logit, ``s >= e^-0.5`` (its maximum's own term is ``exp`` of at most the rounding error of ``x - m``,
        which ``_partial`` fuses with the temperature's product: <= 0.5 while ``|x| < 2^23``), so a subnormal term (0
        when flushed) changes neither ``s + e`` nor ``s e + e_max``."""
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a lane of -inf logits so far adds nothing
        return m_new, s * _exp(m - m_safe, FTZ) + _exp(x - m_safe, FTZ)

    @triton.jit
    def _race_pick(x, g, cols, valid, greedy, best, bidx):
        """One block of a lane's columns: the best race value ``x + g`` (greedy rows: ``x``) and its column.
        Returns ``(best, bidx)``."""
        r = tl.where(valid, x + tl.where(greedy, 0.0, g), -float("inf"))
        take = r > best  # (a lane sees its columns in order: the first of equal values stays)
        return tl.where(take, r, best), tl.where(take, cols, bidx)

    @triton.jit
    def _partial(L, T, Seeds, PM, PS, PB, PI, V, sl, st, per_split, NS,
                 BLOCK: tl.constexpr, FTZ: tl.constexpr):
        row = tl.program_id(0)
        sp = tl.program_id(1)
        t = tl.load(T + row * st).to(tl.float32)
        greedy = t == 0.0
        inv = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
        seed = tl.load(Seeds + row).to(tl.uint64, bitcast=True)
        start = sp * per_split
        end = tl.minimum(start + per_split, V)
        # per lane (column offset within the block): the running maximum and sum of exponentials, the best race
        # value and its column; reduced across lanes once, after the loop (a reduction per block stalls the
        # program on its warps' barrier three times a block: session 24)
        m = tl.full([BLOCK], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], -float("inf"), tl.float32)
        bidx = tl.zeros([BLOCK], tl.int32) + start
        lanes = tl.arange(0, BLOCK).to(tl.uint64) * GOLDEN  # (the lanes' part of the splitmix state: _noise_at)
        for off in range(start, end, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            valid = cols < end
            x = tl.load(L + row.to(tl.int64) * sl + cols, mask=valid, other=-float("inf")).to(tl.float32) * inv
            m, s = _lse_step(x, m, s, FTZ)
            g = _noise_at(seed + tl.cast(off + 1, tl.uint64) * GOLDEN + lanes)
            best, bidx = _race_pick(x, g, cols, valid, greedy, best, bidx)
        m_all = tl.max(m, 0)
        m_all_safe = tl.where(m_all == -float("inf"), 0.0, m_all)
        s_all = tl.sum(s * tl.exp(m - m_all_safe), 0)
        b_all = tl.max(best, 0)
        i_all = tl.min(tl.where(best == b_all, bidx, end), 0)  # the first column of the best value, as argmax
        at = row * NS + sp
        tl.store(PM + at, m_all)
        tl.store(PS + at, s_all)
        tl.store(PB + at, b_all)
        tl.store(PI + at, i_all)

    @triton.jit
    def _combine(L, T, PM, PS, PB, PI, Tok, Lp, sl, st, NS, BLOCK_S: tl.constexpr):
        row = tl.program_id(0)
        k = tl.arange(0, BLOCK_S)
        ok = k < NS
        m = tl.load(PM + row * NS + k, mask=ok, other=-float("inf"))
        s = tl.load(PS + row * NS + k, mask=ok, other=0.0)
        b = tl.load(PB + row * NS + k, mask=ok, other=-float("inf"))
        idx = tl.load(PI + row * NS + k, mask=ok, other=0)
        m_all = tl.max(m, 0)
        lse = m_all + tl.log(tl.sum(tl.where(ok, s * tl.exp(m - m_all), 0.0), 0))
        _, j = tl.max(b, 0, return_indices=True, return_indices_tie_break_left=True)
        tok = tl.sum(tl.where(k == j, idx, 0), 0)
        t = tl.load(T + row * st).to(tl.float32)
        inv = 1.0 / tl.where(t == 0.0, 1.0, t)  # as _partial scaled the logits
        x = tl.load(L + row.to(tl.int64) * sl + tok).to(tl.float32) * inv
        tl.store(Tok + row, tok.to(tl.int64))
        tl.store(Lp + row, (x - lse).to(Lp.dtype.element_ty))


def race_kernel(logits: torch.Tensor, temperature: torch.Tensor, row_seeds: torch.Tensor,
                tokens: torch.Tensor | None = None, logp: torch.Tensor | None = None,
                splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. ``temperature``: ``[B]`` or one element (every row);
    ``tokens``/``logp``: ``[B]`` outputs to write (contiguous; new ones if None)."""
    B, V = logits.shape
    assert logits.stride(1) == 1 and row_seeds.shape == (B,) and row_seeds.dtype == torch.int64
    st = 0 if temperature.numel() == 1 else temperature.stride(0)
    if splits is None:
        splits = max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // max(B, 1)), -(-V // BLOCK)))
    per = -(-(-(-V // splits)) // BLOCK) * BLOCK  # columns per split, whole blocks
    NS = -(-V // per)
    dev = logits.device
    part = torch.empty(3, B, NS, device=dev, dtype=torch.float32)
    pidx = torch.empty(B, NS, device=dev, dtype=torch.int32)
    tokens = torch.empty(B, device=dev, dtype=torch.int64) if tokens is None else tokens
    logp = torch.empty(B, device=dev, dtype=torch.float32) if logp is None else logp
    _partial[(B, NS)](logits, temperature, row_seeds, part[0], part[1], part[2], pidx, V, logits.stride(0), st, per, NS,
                      BLOCK=BLOCK, FTZ=_FTZ, num_warps=NUM_WARPS)
    _combine[(B,)](logits, temperature, part[0], part[1], part[2], pidx, tokens, logp, logits.stride(0), st, NS,
                   BLOCK_S=max(2, triton.next_power_of_2(NS)), num_warps=1)
    return tokens, logp
