"""The decode step's Q/K norms, RoPE, K/V write and query layouts in one Triton kernel.

After a decode step's Q/K/V product (``qkv [B, (Hq + 2 Hkv) x D]``, one token per row) the
block needs, per head: the Q/K RMS norms (Qwen3), the rotary embedding of queries and keys,
the new key and value written into the row store's block pool, and the queries in the two
layouts of the two-level attention (:func:`~treerl.rollout.shared.split_queries`). Compiled
by inductor these are 4-5 small kernels per layer (one per output layout), each a few
microseconds of launch and tail at 64 rows; here one program per (row, KV head) does them all
for the head's keys, values and its ``Hq/Hkv`` query heads (session 24: one program per head
before, ~16 us a layer at 1,024 rows, 1.5 TB/s).

The math is :func:`treerl.rollout.layer_math.qkv_rope`'s after the product: the norm in float32,
rounded to the input dtype before its weight (as the modules do), RoPE
``x cos + rotate_half(x) sin`` on the whole head (``cos/sin [B, D]``: the model's rotary
embedding, any scaling), in float32, each output rounded once. Checked against that
torch path before its first use (:func:`~treerl.rollout.blocks.DecodeBlocks`).

As a link of the small-row chain (:mod:`~treerl.rollout.small_products`, ``pdl``): the kernel takes the
Q/K/V product as its float32 partial sums (:func:`~treerl.rollout.small_products.linear_partials`), adds
them up and rounds the sum to the model's dtype (what the product's output holds), lets the next launch
start and waits for the product before its first read (session 31: the product and this kernel were the
step's two launches a layer that started only after the kernel before them had ended).
"""

from __future__ import annotations

import torch

from .small_products import link_options

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only torch has no triton
    triton = None

if triton is not None:

    @triton.jit
    def _norm_rope(x1, x2, W, eps, c1, s1, c2, s2, HALF: tl.constexpr, NORM: tl.constexpr, DT: tl.constexpr):
        """Heads as two float32 halves ``[heads, HALF]``: RMS norm per head (``NORM``: rounded to
        ``DT`` before the weight, as the modules do), then RoPE (``c1 ... s2 [1, HALF]``); returns the
        two halves."""
        if NORM:
            r = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
            h = tl.arange(0, HALF)[None, :]
            x1 = (x1 * r[:, None]).to(DT).to(tl.float32) * tl.load(W + h).to(tl.float32)
            x2 = (x2 * r[:, None]).to(DT).to(tl.float32) * tl.load(W + HALF + h).to(tl.float32)
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2

    @triton.jit
    def _product(row, at, mask, sps, NP: tl.constexpr, DT: tl.constexpr):
        """Elements ``at`` of one row of the Q/K/V product, in float32: the product's own values (``NP`` 0), or
        the sum of its ``NP`` float32 partials (``sps`` apart, in order) rounded to ``DT`` as the product is."""
        x = tl.load(row + at, mask=mask, other=0.0)
        if NP > 0:
            for s in tl.static_range(1, NP):
                x += tl.load(row + s * sps + at, mask=mask, other=0.0)
            x = x.to(DT)
        return x.to(tl.float32)

    @triton.jit
    def _rope_write_kernel(QKV, Cos, Sin, QW, KW, OK, OV, Block, Offset, QOwn, QPre, KOut, VOut,
                           sqkv, sps, scs, sok_b, sok_h, sok_s, sov_b, sov_h, sov_s, q_eps, k_eps,
                           HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                           HALF: tl.constexpr, DV: tl.constexpr, NORM: tl.constexpr, BLOCK_G: tl.constexpr,
                           NP: tl.constexpr = 0, PDL: tl.constexpr = False):
        b = tl.program_id(0)
        kv = tl.program_id(1)  # a key/value head and its GQ query heads
        if PDL:  # a link of the chain: the next launch may start; the product's partials are read after it ends
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        D: tl.constexpr = 2 * HALF
        GQ: tl.constexpr = HQ // HKV
        i = tl.arange(0, HALF)[None, :]
        j = tl.arange(0, BLOCK_G)[:, None]  # the query heads kv x GQ + j
        has = j < GQ
        row = QKV + b.to(tl.int64) * sqkv
        c1 = tl.load(Cos + b * scs + i).to(tl.float32)
        c2 = tl.load(Cos + b * scs + HALF + i).to(tl.float32)
        s1 = tl.load(Sin + b * scs + i).to(tl.float32)
        s2 = tl.load(Sin + b * scs + HALF + i).to(tl.float32)
        dt = QOwn.dtype.element_ty  # the model's dtype (the product's)
        q_at = (kv * GQ + j) * D
        x1 = _product(row, q_at + i, has, sps, NP, dt)
        x2 = _product(row, q_at + HALF + i, has, sps, NP, dt)
        y1, y2 = _norm_rope(x1, x2, QW, q_eps, c1, s1, c2, s2, HALF, NORM, dt)
        own = QOwn + ((b * HKV + kv) * GQ + j) * D  # q_own [B, HKV, GQ, D]
        pre = QPre + (((b // G) * HKV + kv) * (G * GQ) + (b % G) * GQ + j) * D  # q_pre [B/G, HKV, G GQ, D]
        tl.store(own + i, y1.to(dt), mask=has)
        tl.store(own + HALF + i, y2.to(dt), mask=has)
        tl.store(pre + i, y1.to(dt), mask=has)
        tl.store(pre + HALF + i, y2.to(dt), mask=has)
        k_at = (HQ + kv) * D
        x1 = _product(row, k_at + i, i < HALF, sps, NP, dt)
        x2 = _product(row, k_at + HALF + i, i < HALF, sps, NP, dt)
        y1, y2 = _norm_rope(x1, x2, KW, k_eps, c1, s1, c2, s2, HALF, NORM, dt)
        blk = tl.load(Block + b).to(tl.int64)
        off = tl.load(Offset + b).to(tl.int64)
        dk = OK.dtype.element_ty
        if dk != dt:  # a float8 store: rounded to the model's dtype first, as the torch path does
            y1 = y1.to(dt).to(tl.float32)
            y2 = y2.to(dt).to(tl.float32)
        k_pool = OK + blk * sok_b + kv * sok_h + off * sok_s
        tl.store(k_pool + i, y1.to(dk))
        tl.store(k_pool + HALF + i, y2.to(dk))
        k_out = KOut + (b * HKV + kv) * D
        tl.store(k_out + i, y1.to(dk))
        tl.store(k_out + HALF + i, y2.to(dk))
        d = tl.arange(0, DV)
        v = _product(row, (HQ + HKV) * D + kv * DV + d, d < DV, sps, NP, dt)
        dv = OV.dtype.element_ty
        if dv != dt:  # (a float8 store: from the model's dtype's value, as the torch path rounds)
            v = v.to(dt).to(tl.float32)
        tl.store(OV + blk * sov_b + kv * sov_h + off * sov_s + d, v.to(dv))
        tl.store(VOut + (b * HKV + kv) * DV + d, v.to(dv))


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.nn.Module | None,
               k_norm: torch.nn.Module | None, heads: int, kv_heads: int, G: int, own_k: torch.Tensor,
               own_v: torch.Tensor, block: torch.Tensor, offset: torch.Tensor, *, dtype: torch.dtype | None = None,
               pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv [B, 1, (Hq + Hkv) x D + Hkv x Dv]`` (the product), or its float32 partial sums ``[S, B, ..]``
    (:func:`~treerl.rollout.small_products.linear_partials`; ``dtype``: the product's, which their sum is
    rounded to), ``cos/sin [B, 1, D]``, the Q/K norm modules (None: no Q/K norms) -> ``q_own [B, Hkv, gq, D]``,
    ``q_pre [B/G, Hkv, G gq, D]``, the token's ``k [B, Hkv, D]`` and ``v [B, Hkv, Dv]`` (post-RoPE), also
    written into the pools ``own_k/own_v [blocks, Hkv, PAGE, D]`` at slot ``offset[i]`` of block ``block[i]``
    (``k/v`` in the pools' dtype: a float8 store's values, rounded to the model's dtype first). ``pdl``
    (CUDA sm_90+): a link of the small-row chain (see the module docstring)."""
    D = cos.shape[-1]
    B = cos.shape[0]
    partials = dtype is not None
    if partials:
        assert qkv.dim() == 3 and qkv.dtype == torch.float32 and qkv.shape[1] == B, (qkv.shape, qkv.dtype, B)
        rows, sps, n = qkv[0], qkv.stride(0), qkv.shape[0]
    else:
        rows, sps, n, dtype = qkv.reshape(B, -1), 0, 0, qkv.dtype
    Dv = (rows.shape[-1] - (heads + kv_heads) * D) // kv_heads
    cos, sin = cos.reshape(B, D), sin.reshape(B, D)
    assert rows.stride(1) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride() and B % G == 0
    q_own = torch.empty(B, kv_heads, heads // kv_heads, D, device=rows.device, dtype=dtype)
    q_pre = torch.empty(B // G, kv_heads, G * (heads // kv_heads), D, device=rows.device, dtype=dtype)
    k = own_k.new_empty(B, kv_heads, D)
    v = own_v.new_empty(B, kv_heads, Dv)
    norm = q_norm is not None
    link = link_options(pdl)
    _rope_write_kernel[(B, kv_heads)](
        rows, cos, sin, q_norm.weight if norm else rows, k_norm.weight if norm else rows, own_k, own_v, block, offset,
        q_own, q_pre, k, v, rows.stride(0), sps, cos.stride(0),
        own_k.stride(0), own_k.stride(1), own_k.stride(2), own_v.stride(0), own_v.stride(1), own_v.stride(2),
        float(q_norm.variance_epsilon) if norm else 0.0, float(k_norm.variance_epsilon) if norm else 0.0,
        HQ=heads, HKV=kv_heads, G=G, HALF=D // 2, DV=Dv, NORM=norm, BLOCK_G=triton.next_power_of_2(heads // kv_heads),
        NP=n, num_warps=1, **link,
    )
    return q_own, q_pre, k, v
