"""The decode step's products after attention at small row counts (up to :data:`MAX_ROWS`), in Triton.

At 64 rows a layer's products each read their weights once (Qwen3-0.6B: 4-12 MB) and are
bound by their own latency, not the HBM: cuBLAS runs them at ~1.3 TB/s on an H200, 5-8.5 us
each, because a 1,024-column output (the output and down products) makes 8-32 tiles of its
column tiling for 132 SMs, and its split-K variant adds a reduction kernel (session 25's
profile: 0.70 ms of a 2.35 ms step). Here each product is split over enough programs to
reach every SM (:data:`PROGRAMS`), in column tiles of a few dozen columns and, where columns
are few, in ranges of the inner dimension (session 26, H200, 64 rows, 28 layers' weights a
replay: the block's tail after attention 27.3 -> 21.6 us a layer; the Q/K/V product, 4,096
columns, stays with cuBLAS outside the chain, which ran it faster than this kernel alone: 5.5 against 6.3 us; as
a link of the chain, summed in the rope kernel, the pair is faster: session 31, 7.08 against 8.35 us):

- :func:`linear_partials` — ``x [M, K] @ w[N, K]^T`` as ``S`` float32 partial sums over ranges of ``K``,
  ``[S, M, N]``: the caller adds them up where it reads the product anyway (the decode
  step's residual + norm: :func:`residual_norm`; the Q/K/V product's in
  :func:`~treerl.rollout.rope_kernel.rope_write`): no kernel of its own;
- :func:`gated` — the MLP's gate and up products and ``silu(gate) * up`` in one kernel
  (``w [2 I, K]``, gate rows first, as :class:`~treerl.rollout.blocks.FusedProjections`
  holds them) -> ``[M, I]``.

- :func:`residual_norm` — the partial sums added up with the bias and the residual, and an RMSNorm of the
  result, in one kernel (where the norms are plain RMSNorms: :func:`plain_rmsnorm`).

**A chain of dependent launches** (``pdl``, CUDA sm_90+: :func:`chains_here`; at least
:data:`CHAIN_MIN_ROWS` rows): each kernel first lets the next launch in the stream start
(``griddepcontrol.launch_dependents``), and waits for the kernel before it (``griddepcontrol.wait``: it has
finished and its writes are visible) before reading its activations, so a launch's start overlaps the
kernel before it. Nothing is written before the wait, so a buffer the kernel before it still reads is
never overwritten; the arithmetic is the same, so the output is the same bits. (Session 27 also had each
product prefetch its weight slice into the L2 before its wait: no change on the H200, 19.5 against 19.3 us a
layer at 64 rows; removed.)

**Tiles through tensor descriptors** (:data:`TMA`, CUDA sm_90+ and Triton's interpreter: :func:`_tma`): the
products' ``x`` and weight tiles are TMA copies, one a tile, instead of per-thread addresses. Session 28, H200,
Nsight Compute at 64 rows: the pointer gate/up kernel issued ~310 instructions a K step per thread with one warp a
scheduler, an instruction every ~4.7 cycles, bound by its instruction stream; with TMA ~137, each waiting longer (5.5
cycles; the output partials 5.5 -> 7.5): bound by the copies' and barriers' latency. The chained tail 19.97 -> 17.35
us a layer (:func:`_stages`). The same tiles summed in the same order (the tests check both ways against float64);
the pointer kernels serve older GPUs.

Each accumulates in float32 and rounds where the modules round (a product's output, the
activation, the gated product), so the values are the modules' up to the order of the
float32 sums. The decode step admits them with a probe against its torch path
(:meth:`~treerl.rollout.blocks.DecodeBlocks`); the tests check them against float64.
"""

from __future__ import annotations

import os

import torch

from ..models import is_rmsnorm

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only torch has no triton
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - a Triton without host-side tensor descriptors: the pointer kernels
    TensorDescriptor = None

# rows at most (a step's batch bucket) for these kernels; larger batches run cuBLAS, whose tiles fill the GPU there
MAX_ROWS = 128
# programs to launch at least (one per SM of an H100/H200): column tiles, then ranges of K, are chosen to reach it
PROGRAMS = 128
BLOCK_K = 128
SPLITS_MAX = 8
# the products' tiles through tensor descriptors (TMA) on sm_90+ (session 28: the pointer kernels issue ~310
# instructions a K step per thread, one warp a scheduler, ~4.7 cycles each: bound by their own instruction stream)
TMA = True


# rows at least for the chain of dependent launches (session 27, H200, the tail alone over 28 layers' weights: 64
# rows 20.1 -> 19.3 us a layer, 128 rows 27.1 -> 26.5; 16 rows 19.1 -> 22.7-25.0, slower)
CHAIN_MIN_ROWS = 64


if triton is not None:
    from .silu_gate import silu_times  # (the SiLU gate's roundings: one home)

    @triton.jit
    def _link_start(PDL: tl.constexpr):
        """A product's start as a link of the chain (``PDL``): let the next launch start, then wait for the kernel
        before (it has ended, its writes visible) before any read of its activations."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def _tile(T, row0, rows, stride, k, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
        """Rows ``row0 ..`` (``BLOCK_R``) and columns ``k ..`` (``BLOCK_K``) of ``T [rows, K]``: through its tensor
        descriptor (``TMA``: one copy, rows past its shape zeros) or per-thread addresses (rows past ``rows`` zeros;
        ``stride``: ``T``'s row stride)."""
        if TMA:
            t = T.load([row0, k])
        else:
            r = row0 + tl.arange(0, BLOCK_R)
            t = tl.load(T + r[:, None].to(tl.int64) * stride + (k + tl.arange(0, BLOCK_K))[None, :],
                        mask=r[:, None] < rows, other=0.0)
        return t

    @triton.jit
    def _partials_kernel(X, W, P, M, N, K_PER, sxm, swn, spm, sps,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                         TMA: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program (column tile, K range, row tile): ``P[s] = X[:, K range] @ W[cols, K range]^T``
        in float32; ``X``/``W`` tensor descriptors (``TMA``) or pointers (:func:`_tile`; ``PDL``: a link of the
        chain, see the module docstring)."""
        n, s, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = n * BLOCK_N + tl.arange(0, BLOCK_N)
        _link_start(PDL)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(s * K_PER, (s + 1) * K_PER, BLOCK_K):
            x = _tile(X, mb * BLOCK_M, M, sxm, k, BLOCK_M, BLOCK_K, TMA)
            w = _tile(W, n * BLOCK_N, N, swn, k, BLOCK_N, BLOCK_K, TMA)
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        tl.store(P + s * sps + rm[:, None] * spm + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _gated_kernel(X, W, Out, M, I, K, sxm, swn, som,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                      TMA: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program (column tile, row tile): ``Out = silu(g) * u`` with ``g = X @ W[cols]^T`` and
        ``u = X @ W[I + cols]^T``, each rounded to ``Out``'s dtype as the modules round them (``X``/``W`` as
        :func:`_partials_kernel` takes them; a gate tile past ``I`` reads up rows, or zeros, into columns that are
        not stored; an up tile past ``2 I`` reads zeros)."""
        n, mb = tl.program_id(0), tl.program_id(1)
        rm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = n * BLOCK_N + tl.arange(0, BLOCK_N)
        _link_start(PDL)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = _tile(X, mb * BLOCK_M, M, sxm, k, BLOCK_M, BLOCK_K, TMA)
            wg = _tile(W, n * BLOCK_N, I, swn, k, BLOCK_N, BLOCK_K, TMA)
            wu = _tile(W, I + n * BLOCK_N, 2 * I, swn, k, BLOCK_N, BLOCK_K, TMA)
            if IEEE:
                acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision="ieee")
                acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(x, tl.trans(wg), acc_g)
                acc_u = tl.dot(x, tl.trans(wu), acc_u)
        dt = Out.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        tl.store(Out + rm[:, None] * som + rn[None, :], silu_times(g, u, dt), mask=(rm[:, None] < M) & (rn[None, :] < I))

    @triton.jit
    def _residual_norm_kernel(Hidden, P, Bias, Wn, OutH, OutX, H, eps, shm, spm, sps, som, sxm,
                              S: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr,
                              PDL: tl.constexpr = False):
        """Program (row): ``h = Hidden + round(P[0] + .. + P[S-1] (+ Bias))`` and ``OutX = Wn * round(h /
        rms(h))``, as :func:`~treerl.rollout.layer_math._residual_norm` with an RMSNorm rounds them (the partials
        added in order, in float32; the norm's statistics in float32)."""
        r = tl.program_id(0)
        offs = tl.arange(0, BLOCK_H)
        ok = offs < H
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        wn = tl.load(Wn + offs, mask=ok, other=0.0).to(tl.float32)  # (parameters: read before the wait)
        if HAS_BIAS:
            bias = tl.load(Bias + offs, mask=ok, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
        dt = Hidden.dtype.element_ty
        total = tl.load(P + r * spm + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, S):  # (unrolled: the loads independent)
            total += tl.load(P + s * sps + r * spm + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            total += bias
        h = (tl.load(Hidden + r * shm + offs, mask=ok, other=0.0).to(tl.float32) + total.to(dt).to(tl.float32)).to(dt)
        tl.store(OutH + r * som + offs, h, mask=ok)
        hf = h.to(tl.float32)
        var = tl.sum(hf * hf, 0) / H
        y = (hf * tl.math.rsqrt(var + eps)).to(dt).to(tl.float32)
        tl.store(OutX + r * sxm + offs, (wn * y).to(dt), mask=ok)


def chains_here(device: torch.device | str) -> bool:
    """Whether the kernels run here as a chain of dependent launches (``pdl``): CUDA sm_90+ and a Triton
    with ``griddepcontrol`` (3.3+); never under Triton's interpreter."""
    device = torch.device(device)
    return (triton is not None and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9
            and getattr(getattr(tl.extra, "cuda", None), "gdc_wait", None) is not None)


def plain_rmsnorm(norm: torch.nn.Module, hidden: torch.Tensor) -> bool:
    """Whether :func:`residual_norm` computes ``norm`` on ``hidden``: one of the families' RMSNorms
    (:func:`~treerl.models.is_rmsnorm`) with a weight ``[H]`` in ``hidden``'s dtype (16-bit or float32) and no
    hooks; other norms keep theirs."""
    weight = getattr(norm, "weight", None)
    return (is_rmsnorm(norm, own_forward=True) and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and weight.dtype == hidden.dtype and weight.shape[0] == hidden.shape[-1]
            and hidden.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and not (norm._forward_hooks or norm._forward_pre_hooks))


def _block_m(M: int) -> int:
    return min(triton.next_power_of_2(max(M, 16)), 64)


def _block_k(K: int, block_k: int | None) -> int:
    """The inner dimension's tile: ``block_k``, or the largest of :data:`BLOCK_K`, 64, 32, 16 dividing ``K``."""
    for b in ([block_k] if block_k else [BLOCK_K, 64, 32, 16]):
        if K % b == 0:
            return b
    raise ValueError(f"small_products: the inner dimension {K} is not a multiple of {block_k or 16}; "
                     "check runs_here() before calling")


def _check(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """``x [M, K]`` and ``w [N, K]`` as the kernels read them (contiguous columns, one dtype), or a ValueError."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != w.dtype:
        raise ValueError(f"small_products.{what}: x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} are not "
                         "[M, K] and [N, K] of one dtype")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"small_products.{what}: x and w need contiguous columns (strides {x.stride()}, {w.stride()}); "
                         "pass .contiguous() copies")


def splits_for(N: int, K: int, block_n: int, block_k: int | None = None) -> int:
    """Ranges of ``K`` for ``N`` output columns in tiles of ``block_n``: the fewest (a power of
    two, at most :data:`SPLITS_MAX`) that launch :data:`PROGRAMS` programs, each range a whole
    number of ``block_k`` tiles."""
    block_k = _block_k(K, block_k)
    s, tiles = 1, triton.cdiv(N, block_n)
    while tiles * s < PROGRAMS and s < SPLITS_MAX and K % (2 * s * block_k) == 0:
        s *= 2
    return s


def runs_here(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether these kernels take ``x [M, *]`` and ``weights [N, K]`` (each product's inner
    dimension its weight's): Triton (on CUDA, or its interpreter on the CPU), 16-bit or float32
    values, at most :data:`MAX_ROWS` rows, every ``K`` a multiple of 16, contiguous rows."""
    on = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (triton is not None and on and x.dim() == 2 and x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all(w.dtype == x.dtype and w.dim() == 2 and w.shape[1] % 16 == 0 and w.stride(1) == 1
                    for w in weights))


def _tma(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the products read their tiles through tensor descriptors (:data:`TMA`; CUDA sm_90+, or Triton's
    interpreter; rows apart by at least a row, 16-byte aligned); otherwise through per-thread addresses."""
    here = ((x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9)
            or os.environ.get("TRITON_INTERPRET") == "1")
    return (TMA and TensorDescriptor is not None and here
            and all(t.stride(0) >= t.shape[1] and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
                    for t in (x, w)))


def _tiles_of(x: torch.Tensor, w: torch.Tensor, block_m: int, block_n: int, block_k: int, tma: bool) -> tuple:
    """What the product kernels read ``x`` and ``w`` through: tensor descriptors of their tiles (``tma``), or the
    tensors themselves (pointers)."""
    if not tma:
        return x, w
    return TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(w, [block_n, block_k])


def _stages(x: torch.Tensor, tma: bool) -> int:
    """The products' default pipeline stages: 5 for 16-bit tiles through TMA in a row tile of 64 (33-64 rows),
    else 4. Session 28 on the H200 at 64 rows (call 3, each product alone): output product 4.52 -> 4.30 us, down
    5.25 -> 4.99, gate/up 6.98 -> 6.66 against 4; call 4, the chained tail 17.35 us a layer against 19.97 with
    pointer tiles (call 2 at 4 stages: 18.21 against 20.05). At 128 rows 5 stages ran the chained tail at 26.23 us
    (call 4) against 22.72 at 4 (call 2). Session 29 (call 4, each product alone at its default tiles): at 32 rows 5
    stages are slower (gate/up 8.45 against 8.10 us, output 4.24 / 4.15, down 4.82 / 4.73), at 16 rows the same
    within 0.1 us. The pointer kernels keep session 26's 4; float32 tiles take twice the shared memory (the gated
    kernel at 4 stages: 229 KB of 232)."""
    return 5 if tma and x.element_size() == 2 and 32 < x.shape[0] <= 64 else 4


def link_options(pdl: bool) -> dict:
    """A kernel's launch options as a link of the chain (``pdl``) or not (its ``PDL`` constexpr and
    Triton's ``launch_pdl``)."""
    return dict(PDL=True, launch_pdl=True) if pdl else {}


def linear_partials(x: torch.Tensor, w: torch.Tensor, *, splits: int | None = None, block_n: int = 32,
                    block_k: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                    pdl: bool = False) -> torch.Tensor:
    """``x [M, K] @ w[N, K]^T`` as ``S`` float32 partial sums over ranges of ``K`` -> ``[S, M, N]``
    (``S``: ``splits``, default :func:`splits_for`); their sum, rounded to ``x``'s dtype, is the
    product as ``F.linear`` gives it. ``pdl``: a link of the chain (:func:`chains_here`). Tiles: session 26's
    sweep on the H200 at 64 rows (Qwen3-0.6B's output and down products: 32 columns, 4 ranges, 4 stages within 2%
    of the best of 72 settings); stages with TMA: :func:`_stages`."""
    _check(x, w, "linear_partials")
    K = x.shape[1]
    splits = splits or splits_for(w.shape[0], K, block_n, block_k)
    if K % splits:
        raise ValueError(f"small_products: the inner dimension {K} does not split into {splits} equal ranges")
    block_k = _block_k(K // splits, block_k)
    M, N = x.shape[0], w.shape[0]
    out = torch.empty(splits, M, N, device=x.device, dtype=torch.float32)
    block_m = _block_m(M)
    grid = (triton.cdiv(N, block_n), splits, triton.cdiv(M, block_m))
    tma = _tma(x, w)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
                 num_warps=num_warps, num_stages=num_stages or _stages(x, tma), **link_options(pdl))
    _partials_kernel[grid](*_tiles_of(x, w, block_m, block_n, block_k, tma), out, M, N, K // splits, x.stride(0),
                           w.stride(0), out.stride(1), out.stride(0), TMA=tma, **tiles)
    return out


def gated(x: torch.Tensor, w: torch.Tensor, *, block_n: int = 32, block_k: int | None = None, num_warps: int = 4,
          num_stages: int | None = None, pdl: bool = False) -> torch.Tensor:
    """The MLP's gate and up products and ``silu(gate) * up``: ``x [M, K]``, ``w [2 I, K]`` (gate
    rows, then up rows) -> ``[M, I]`` in ``x``'s dtype (``pdl``: a link of the chain)."""
    _check(x, w, "gated")
    if w.shape[0] % 2:
        raise ValueError(f"small_products.gated: w has {w.shape[0]} rows, not gate rows then as many up rows")
    M, K = x.shape
    block_k = _block_k(K, block_k)
    inner = w.shape[0] // 2
    out = x.new_empty(M, inner)
    block_m = _block_m(M)
    grid = (triton.cdiv(inner, block_n), triton.cdiv(M, block_m))
    tma = _tma(x, w)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
                 num_warps=num_warps, num_stages=num_stages or _stages(x, tma), **link_options(pdl))
    _gated_kernel[grid](*_tiles_of(x, w, block_m, block_n, block_k, tma), out, M, inner, K, x.stride(0), w.stride(0),
                        out.stride(0), TMA=tma, **tiles)
    return out


def residual_norm(hidden: torch.Tensor, partials: torch.Tensor, bias: torch.Tensor | None, norm: torch.nn.Module, *,
                  pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [B, 1, H]`` plus the product given as float32 partial sums ``partials [S, B, H]``
    (:func:`linear_partials`; their sum and ``bias`` rounded once to ``hidden``'s dtype) and ``norm`` (an
    RMSNorm, :func:`plain_rmsnorm`) of the result, in one kernel: ``(hidden, norm(hidden))``, each ``[B, 1,
    H]`` (``pdl``: a link of the chain)."""
    B, H = hidden.shape[0], hidden.shape[-1]
    if not plain_rmsnorm(norm, hidden) or partials.shape[1:] != (B, H) or partials.stride(2) != 1:
        raise ValueError(f"small_products.residual_norm: {type(norm).__name__} over hidden {tuple(hidden.shape)} "
                         f"{hidden.dtype} with partials {tuple(partials.shape)} is not a plain RMSNorm of [S, B, H] "
                         "sums; check plain_rmsnorm() first")
    flat = hidden.reshape(B, H)
    out_h, out_x = torch.empty_like(flat), torch.empty_like(flat)
    block_h = triton.next_power_of_2(H)
    _residual_norm_kernel[(B,)](
        flat, partials, bias if bias is not None else flat, norm.weight, out_h, out_x, H, float(norm.variance_epsilon),
        flat.stride(0), partials.stride(1), partials.stride(0), out_h.stride(0), out_x.stride(0),
        S=partials.shape[0], HAS_BIAS=bias is not None, BLOCK_H=block_h, num_warps=4 if block_h <= 2048 else 8,
        **link_options(pdl))
    return out_h.view_as(hidden), out_x.view_as(hidden)
