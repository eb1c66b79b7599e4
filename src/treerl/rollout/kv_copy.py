"""Runs of K/V slots copied between stores, dense or paged, every layer in one launch (Triton).

A prefill's K/V goes into the running batch's stores (an admitted served row's whole context
into its own blocks; prompts into the prompt store, fork segments), and a finished row's
context from its own blocks into a prefix-cache entry. Advanced indexing
(``pool[:, blk, :, off] = x``) moves those 2-byte elements one at a time through an index
kernel: session 15's serving profile (H200) spent 0.26 + 0.15 ms a decode step there, ~8%
of the device time. Here each program copies a tile of ``BLOCK_T`` slots of one row and one
layer, head by head, each slot's ``D`` values one contiguous (vectorised) load and store.

A store is ``[layers, entries, heads, slots, D]`` (``D`` contiguous). Dense: entry ``r``'s
slot ``j``. Paged (``table [rows, max_blocks]``): the entries are blocks of ``PAGE`` slots
and row ``r``'s slot ``j`` is slot ``j % PAGE`` of block ``table[r, j // PAGE]``.
"""

from __future__ import annotations

import functools

import torch

from .kernel_probe import kernel_agrees
from .types import stored

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only torch has no triton
    triton = None

BLOCK_T = 32  # slots a program copies (of one row and layer)

if triton is not None:

    @triton.jit
    def _copy_kernel(Src, Dst, SrcTable, DstTable, SrcRow, SrcStart, DstRow, DstStart, Count,
                     sl, se, sh, st, dl, de, dh, dt, sts, dts,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, SRC_PAGE: tl.constexpr,
                     DST_PAGE: tl.constexpr):
        i = tl.program_id(0)
        layer = tl.program_id(2).to(tl.int64)
        t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = t < tl.load(Count + i)
        offs_d = tl.arange(0, D)
        js = tl.load(SrcStart + i).to(tl.int64) + t
        jd = tl.load(DstStart + i).to(tl.int64) + t
        rs = tl.load(SrcRow + i).to(tl.int64)
        rd = tl.load(DstRow + i).to(tl.int64)
        if SRC_PAGE == 0:
            src_at = Src + layer * sl + rs * se + js * st
        else:
            blk = tl.load(SrcTable + rs * sts + js // SRC_PAGE, mask=ok, other=0).to(tl.int64)
            src_at = Src + layer * sl + blk * se + (js % SRC_PAGE) * st
        if DST_PAGE == 0:
            dst_at = Dst + layer * dl + rd * de + jd * dt
        else:
            blk = tl.load(DstTable + rd * dts + jd // DST_PAGE, mask=ok, other=0).to(tl.int64)
            dst_at = Dst + layer * dl + blk * de + (jd % DST_PAGE) * dt
        for h in tl.static_range(H):
            x = tl.load(src_at[:, None] + h * sh + offs_d[None, :], mask=ok[:, None])
            if x.dtype != Dst.dtype.element_ty:  # (a float8 store: through float32, one rounding, saturated)
                x = x.to(tl.float32).to(Dst.dtype.element_ty)
            tl.store(dst_at[:, None] + h * dh + offs_d[None, :], x, mask=ok[:, None])


def copy_slots(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, src_start: torch.Tensor,
               dst_rows: torch.Tensor, dst_start: torch.Tensor, count: torch.Tensor, max_count: int, *,
               src_table: torch.Tensor | None = None, dst_table: torch.Tensor | None = None) -> None:
    """For each ``i``: ``count[i]`` (at most ``max_count``) slots of row ``src_rows[i]`` of
    ``src`` from slot ``src_start[i]`` on, into row ``dst_rows[i]`` of ``dst`` from slot
    ``dst_start[i]`` on, every layer. ``src``/``dst`` ``[layers, entries, heads, slots, D]``
    (``D`` contiguous; of different dtypes: each value rounded once, as ``Tensor.to`` does, e.g.
    into a float8 store); with ``*_table`` the store is paged (module docstring). Index tensors
    are integer, one entry per copy, on the stores' device."""
    R = len(src_rows)
    if R == 0 or max_count <= 0:
        return
    L, _, H, _, D = src.shape
    assert dst.shape[0] == L and dst.shape[2] == H and dst.shape[4] == D and src.stride(4) == dst.stride(4) == 1
    st = src_table if src_table is not None else src_rows  # (any pointer: not read)
    dt = dst_table if dst_table is not None else dst_rows
    _copy_kernel[(R, triton.cdiv(max_count, BLOCK_T), L)](
        src, dst, st, dt, src_rows, src_start, dst_rows, dst_start, count,
        *src.stride()[:4], *dst.stride()[:4], st.stride(0), dt.stride(0),
        H=H, D=D, BLOCK_T=BLOCK_T, SRC_PAGE=0 if src_table is None else src.shape[3],
        DST_PAGE=0 if dst_table is None else dst.shape[3], num_warps=4)


@functools.lru_cache(maxsize=None)
def copy_slots_ok(device: str, dtype: torch.dtype, head_dim: int, dst_dtype: torch.dtype | None = None) -> bool:
    """Whether :func:`copy_slots` runs here and copies exactly (probed once per device, dtype
    and head size, dense to paged and back; ``dst_dtype``: into a store of that dtype, each
    value as ``Tensor.to`` rounds it, and back; never inside a capture; a failure warns,
    :func:`~treerl.rollout.kernel_probe.kernel_agrees`)."""
    if triton is None or not device.startswith("cuda") or head_dim & (head_dim - 1):
        return False
    dst_dtype = dst_dtype or dtype

    def check() -> bool:
        g = torch.Generator(device=device).manual_seed(0)
        L, H, page = 3, 2, 16
        dense = stored(torch.randn(L, 4, H, 70, head_dim, device=device, generator=g) * 100, dtype)  # (float8: saturated)
        pool = torch.zeros(L, 12, H, page, head_dim, device=device, dtype=dst_dtype)
        table = torch.tensor([[5, 2, 9, 11, 11], [0, 7, 3, 11, 11]], device=device)
        i64 = lambda *a: torch.tensor(a, device=device, dtype=torch.int64)  # noqa: E731
        copy_slots(dense, pool, i64(3, 1), i64(5, 0), i64(0, 1), i64(0, 0), i64(40, 33), 40, dst_table=table)
        back = torch.zeros(L, 2, H, 40, head_dim, device=device, dtype=dtype)
        copy_slots(pool, back, i64(0, 1), i64(0, 0), i64(1, 0), i64(0, 0), i64(40, 33), 40, src_table=table)
        dense = stored(dense, dst_dtype).to(dtype)  # (each value as the store holds it)
        return (torch.equal(back[:, 1], dense[:, 3, :, 5:45]) and torch.equal(back[:, 0, :, :33], dense[:, 1, :, :33])
                and torch.equal(pool[:, 2].to(dtype), dense[:, 3, :, 21:37]))

    return kernel_agrees(check, what="the K/V slot copy kernel", reference="torch indexing",
                         where=f"{device} ({dtype} into {dst_dtype}, head {head_dim})",
                         fallback="K/V runs are copied by advanced indexing (slower)")
