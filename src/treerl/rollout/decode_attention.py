"""Split-key decode attention with its log-sum-exp, in Triton (flash-decoding).

One decode step's attention is memory-bound: each (batch entry, KV head) reads its keys
and values once for a handful of queries (a row's ``Hq/Hkv`` query heads, or a group's
``G x Hq/Hkv`` queries against the shared prompt). A kernel with one program per (entry,
head) leaves most of the GPU idle when entries are few and long (8 prompts of 1,024
tokens: 64 programs on 132 SMs), and a kernel tiled for prefill wastes most of its query
tile on 2 queries. Here the keys of each (entry, head) are split into ``S`` ranges run by
separate programs (enough programs to fill the GPU), each writing a partial output and
its LSE. :func:`split_attention_merged` runs the rows' own part in one key range per (row,
head) and merges it with the prompt part's ranges in its epilogue (what
:func:`~treerl.rollout.shared.merge_parts` computes), writing the layer's attention output.

``q [B, H, M, D]``, ``k/v [B, H, N, D]`` (any strides, last dim contiguous), additive
``mask`` rows ``[B, N]`` (broadcast over heads and queries) -> ``out [B, H, S, M, Dv]``
(float32) and ``lse [B, H, S, M]`` (float32; ``-inf`` for a range that reads no key: none visible
in it, or, causal, none up to its query block's last query).

Keys the mask hides (mask value ``finfo(mask.dtype).min``) add ``exp(hidden - max) = 0`` to
every softmax sum. Each split first reads its mask for its last visible key and reads K/V
only up to it (tiles past it are not run, and the last tile's keys past it are not loaded:
~32 of a row's keys a step in blocks of 64, session 29): slots past a row's length (the step
attends to the longest row's span) and a prompt shorter than the prefix store are not read, so a
step's attention reads what its rows hold, not ``rows x span``. The loop has no branch per tile,
so its loads pipeline; a hidden run inside a row is read and masked (pools hold finite values).
A range with no visible key reads no K/V and writes ``lse = -inf`` (weight 0 in every merge);
the first range's first key is always read, so every row and query keeps a finite LSE (a dead
row's: over that hidden key).

Paged keys (the rows' own store, :mod:`~treerl.rollout.paging`): ``k/v`` are block pools
``[num_blocks, H, PAGE, D]`` and ``table [B, max_blocks]`` names the block of each entry's
keys ``[j x PAGE, (j + 1) x PAGE)``; ``N`` (keys per entry) is then the mask's width. When
``PAGE`` is a multiple of the key tile (``BLOCK_N``), a tile lies in one block (one table
entry per tile); otherwise each key looks up its block.
"""

from __future__ import annotations

import functools

import torch

from .kernel_probe import kernel_agrees
from .types import raw, stored

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only torch has no triton
    triton = None

# programs to launch at least (~4 per SM of an H100/H200): splits are chosen to reach it
TARGET_PROGRAMS = 528
# the merged own part's programs at least (one per SM): fewer rows x heads over longer keys run in key ranges
MERGED_MIN_PROGRAMS = TARGET_PROGRAMS // 4
BLOCK_N = 64
# queries of one program at most (16-bit, float32): a program's query tile, accumulator and K/V stages live in its
# shared memory (sm_90: 227 KB; of 128: float32 256 queries take 263 KB, 16-bit 512 take 197 KB), so
# larger groups run in slices (tests/rollout/test_triton_compile.py checks the largest tiles' shared memory)
MAX_QUERIES = {False: 512, True: 128}
# a causal launch's queries per program (window_attention: a prefill's 16-256 queries per KV head in blocks, each
# block's programs reading keys up to its last query), and its mask reads' chunk: fixed, so that prefills of any
# bucket share one compiled kernel (a compile inside a serving run stalls every row for ~1 s: session 16 call 3)
CAUSAL_QUERY_BLOCK, CAUSAL_MASK_CHUNK = 64, 256
WINDOW_RANGES = 64  # a prefill window's key ranges at most (the merge's tile: one compiled kernel)

if triton is not None:

    @triton.jit
    def _tile(q, K, V, Table, b, h, offs_n, valid, bias, m_i, l_i, acc, tile_start, last, hidden,
              skb, skh, skn, svb, svh, svn, stb, N, scale,
              BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, IEEE: tl.constexpr, PAGE: tl.constexpr,
              CAUSAL: tl.constexpr):
        """One key tile of :func:`_split_kernel`: the online-softmax update of ``(m_i, l_i, acc)``
        (``CAUSAL``: query ``m`` sees keys up to ``last[m]``; the others score ``hidden``, as masked keys)."""
        offs_d = tl.arange(0, D)
        offs_dv = tl.arange(0, DV)
        if PAGE == 0:  # dense: entry b's keys
            k_at = K + b * skb + h * skh + offs_n[:, None] * skn
            v_at = V + b * svb + h * svh + offs_n[:, None] * svn
        else:  # paged: key j of entry b is slot j % PAGE of block Table[b, j // PAGE]
            if PAGE % BLOCK_N == 0:
                first = tile_start
                blk = tl.load(Table + b * stb + first // PAGE, mask=first < N, other=0).to(tl.int64)
                slot = (offs_n % PAGE)[:, None]
                k_at = K + blk * skb + h * skh + slot * skn
                v_at = V + blk * svb + h * svh + slot * svn
            else:
                blk = tl.load(Table + b * stb + offs_n // PAGE, mask=valid, other=0).to(tl.int64)[:, None]
                slot = (offs_n % PAGE)[:, None]
                k_at = K + blk * skb + h * skh + slot * skn
                v_at = V + blk * svb + h * svh + slot * svn
        k = tl.load(k_at + offs_d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)  # (fp8 stores: widened)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale + bias[None, :]
        if CAUSAL:  # (the score replaced, not added to: finite, so a query with no key in the tile stays finite)
            s = tl.where(offs_n[None, :] <= last[:, None], s, hidden)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_at + offs_dv[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _split_kernel(Q, K, V, Mask, O, L, Table, O2, L2,
                      sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, smb, stb,
                      sob, soh, sos, som, slb, slh, sls,
                      s2b, s2h, s2s, s2m, t2b, t2h, t2s, S2, G2,
                      H, M, N, keys_per_split, scale, HIDDEN, Q0, QW,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                      IEEE: tl.constexpr, PAGE: tl.constexpr, MASK_CHUNK: tl.constexpr, MERGE: tl.constexpr,
                      CAUSAL: tl.constexpr, TRIGGER: tl.constexpr = False, WAIT: tl.constexpr = False,
                      LINKED: tl.constexpr = False):
        if LINKED:  # launched dependent on the kernel that writes the queries (the chain's rope kernel): wait for it
            tl.extra.cuda.gdc_wait()  # first, so a launch this one lets start (TRIGGER) starts after it too
        if TRIGGER:  # the next launch (the merged own part, launched dependent) may start beside this one
            tl.extra.cuda.gdc_launch_dependents()
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's block of the M queries
        offs_d = tl.arange(0, D)
        offs_dv = tl.arange(0, DV)
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                    mask=offs_m[:, None] < M, other=0.0)
        if K.dtype.element_ty.is_fp8() and not IEEE:  # float8 K/V: the products in float16, which holds every float8
            q = q.to(tl.float16)  # value exactly and a bf16 query's 8 bits (Hopper widens float8 to float16 in one step)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DV], tl.float32)
        start = split * keys_per_split  # keys_per_split: whole blocks; split starts < N
        # the split's visible keys end before `end` (the mask, read alone first: ~1/128 of the K/V bytes); the K/V
        # loop runs to that bound without a branch per tile, so the compiler pipelines its loads. Tiles past the
        # row's last visible key (rows shorter than the step's span, prompts shorter than the prefix store) are not
        # read, nor are ranges with no visible key (their LSE -inf: the merges weigh them 0); the first range's first
        # tile always runs, so every row keeps a finite LSE (session 17: empty ranges read a tile each before, ~40%
        # of a 4,096-slot prefill window's K/V reads over a 2,400-token context)
        stop = tl.minimum(start + keys_per_split, N)
        first = (split == 0).to(tl.int32)  # 1: the range that always reads its first tile
        end = start + first
        for c in range(start, stop, MASK_CHUNK):
            offs_c = c + tl.arange(0, MASK_CHUNK)
            seen = tl.load(Mask + b * smb + offs_c, mask=offs_c < stop, other=HIDDEN).to(tl.float32) > HIDDEN
            end = tl.maximum(end, tl.max(tl.where(seen, offs_c + 1, 0), 0))
        last = Q0 + offs_m % QW  # CAUSAL: query m's last visible key (its slot); tiles past the block's last unread
        if CAUSAL:
            end = tl.maximum(tl.minimum(end, tl.max(tl.where(offs_m < M, last, 0), 0) + 1), start + first)
        for i in range(0, tl.cdiv(end - start, BLOCK_N)):
            offs_n = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = offs_n < end  # (end <= N: the last tile's keys past the last visible one are not loaded)
            bias = tl.load(Mask + b * smb + offs_n, mask=valid, other=0.0).to(tl.float32)
            m_i, l_i, acc = _tile(q, K, V, Table, b, h, offs_n, valid, bias, m_i, l_i, acc, start + i * BLOCK_N,
                                  last, HIDDEN, skb, skh, skn, svb, svh, svn, stb, N, scale,
                                  BLOCK_N, D, DV, IEEE, PAGE, CAUSAL)
        has = l_i > 0
        out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        keep = offs_m < M
        if MERGE:  # one key range (split 0): merged here with the other part's S2 ranges of query r x M + m of
            # group b // G2 (r = b % G2) by their LSEs, the result written as O [B, 1, H x M, DV] (its dtype)
            rows = (b % G2) * M + offs_m
            if WAIT:  # launched dependent on the kernel that writes O2/L2: its partials are read only after it ends
                tl.extra.cuda.gdc_wait()
            run = lse
            den = tl.where(has, 1.0, 0.0)
            for j in range(0, S2):
                l2 = tl.load(L2 + (b // G2) * t2b + h * t2h + j * t2s + rows, mask=keep, other=float("-inf"))
                o2 = tl.load(O2 + (b // G2) * s2b + h * s2h + j * s2s + rows[:, None] * s2m + offs_dv[None, :],
                             mask=keep[:, None], other=0.0)
                new = tl.maximum(run, l2)
                safe = tl.where(new == float("-inf"), 0.0, new)  # neither part has keys yet: weights 0
                a = tl.exp(run - safe)
                w2 = tl.exp(l2 - safe)  # (not `c`: the mask loop's int32 variable above)
                out = out * a[:, None] + o2 * w2[:, None]
                den = den * a + w2
                run = new
            out = out / tl.where(den > 0, den, 1.0)[:, None]
            tl.store(O + b * sob + (h * M + offs_m)[:, None] * soh + offs_dv[None, :], out.to(O.dtype.element_ty),
                     mask=keep[:, None])
        else:
            tl.store(O + b * sob + h * soh + split * sos + offs_m[:, None] * som + offs_dv[None, :], out,
                     mask=keep[:, None])
            tl.store(L + b * slb + h * slh + split * sls + offs_m, lse, mask=keep)


    @triton.jit(do_not_specialize=["S1", "S2"])  # (one compiled variant for any count of ranges: BLOCK_S1/S2)
    def _merge_kernel(O1, L1, O2, L2, Out, s1b, s1h, s1s, s1m, t1b, t1h, t1s, s2b, s2h, s2s, s2m, t2b, t2h, t2s,
                      sob, som, S1, S2, G, M, DV: tl.constexpr, BLOCK_S1: tl.constexpr, BLOCK_S2: tl.constexpr):
        """One (row, query head) of :func:`merge_ranges`: its own part's ``S1`` key ranges and its
        group's prompt part's ``S2``, weighted by ``exp(lse - lse_all)`` (the ranges' outputs one
        at a time: a row over long keys has up to ~66 of them)."""
        b = tl.program_id(0)
        hm = tl.program_id(1)  # h x M + m: the query head
        h, m = hm // M, hm % M
        g, qm = b // G, (b % G) * M + m  # the row's group, and its query among the group's prompt-part queries
        i1, i2, dv = tl.arange(0, BLOCK_S1), tl.arange(0, BLOCK_S2), tl.arange(0, DV)
        l1_at, l2_at = L1 + b * t1b + h * t1h + m, L2 + g * t2b + h * t2h + qm
        l1 = tl.load(l1_at + i1 * t1s, mask=i1 < S1, other=float("-inf"))
        l2 = tl.load(l2_at + i2 * t2s, mask=i2 < S2, other=float("-inf"))
        top = tl.maximum(tl.max(l1, 0), tl.max(l2, 0))
        total = tl.sum(tl.exp(l1 - top), 0) + tl.sum(tl.exp(l2 - top), 0)
        o1_at, o2_at = O1 + b * s1b + h * s1h + m * s1m + dv, O2 + g * s2b + h * s2h + qm * s2m + dv
        acc = tl.zeros([DV], dtype=O1.dtype.element_ty)
        for s in range(0, S1):
            acc += tl.exp(tl.load(l1_at + s * t1s) - top).to(acc.dtype) * tl.load(o1_at + s * s1s).to(acc.dtype)
        for s in range(0, S2):
            acc += tl.exp(tl.load(l2_at + s * t2s) - top).to(acc.dtype) * tl.load(o2_at + s * s2s).to(acc.dtype)
        tl.store(Out + b * sob + hm * som + dv, (acc / total).to(Out.dtype.element_ty))

    # The same two kernels for a prefill window's launches (window_attention), not specialised on its sizes: prefills
    # come in any length (chunked ones, past the small prefills' buckets), and each new divisibility pattern of the
    # sizes would compile a variant (~1 s) while every running row waits (session 16 calls 3-4: probes of 0.77-1.16 s).
    # The head dimension's strides (multiples of 16) stay specialised: the K/V and query loads keep their width (the
    # mask's rows, read through the last query's, are not aligned to 16 bytes in general).
    _split_kernel_any = triton.jit(_split_kernel.fn, do_not_specialize=[
        "Mask", "Table", "M", "N", "H", "keys_per_split", "Q0", "QW", "smb", "stb", "slb", "slh", "sls"])
    _merge_kernel_any = triton.jit(_merge_kernel.fn, do_not_specialize=[
        "S1", "S2", "M", "t1b", "t1h", "t1s", "t2b", "t2h", "t2s"])


def splits_for(batch: int, heads: int, keys: int, target: int = TARGET_PROGRAMS, block_n: int = BLOCK_N) -> int:
    """Key ranges per (entry, head): enough programs to fill the GPU, >= one block each."""
    want = -(-target // max(batch * heads, 1))
    return max(1, min(want, -(-keys // block_n)))


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                    splits: int | None = None, *, table: torch.Tensor | None = None, block_n: int = BLOCK_N,
                    target: int = TARGET_PROGRAMS, num_warps: int | None = None,
                    num_stages: int = 2, causal: tuple[int, int] | None = None,
                    trigger: bool = False, linked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; ``mask`` is ``[B, 1, 1, N]`` or ``[B, N]``; ``table``
    ``[B, max_blocks]`` (integer): ``k/v`` are block pools ``[blocks, H, PAGE, D]`` read
    through it, ``N`` = the mask's width. ``causal = (Q0, QW)``: query ``m`` also sees no key
    past ``Q0 + m % QW`` (a prefill window's queries, ``M = G x QW``: see
    :func:`window_attention`); its queries run in blocks of ``CAUSAL_QUERY_BLOCK``, each
    block's programs reading keys up to its last query. ``trigger`` (CUDA, sm_90+): each
    program first lets the next launch in the stream start beside this one, where that launch
    is dependent (:func:`split_attention_merged` with ``after``). ``linked`` (CUDA, sm_90+): the launch is
    dependent on the kernel before it (the small-row chain's rope kernel, which lets it start) and each program
    waits for that kernel before anything else. The other keyword arguments are
    kernel settings (``bench/tune_split_attention.py`` and ``bench/decode_kernels.py --attention-sweep`` measure
    them; 2 stages: session 29 on an H200 measured 3-4 stages no faster alone at 64 rows x 256 own keys, 26.65 ->
    26.78 us a layer, and ``bench_rollout`` at 64 rows 2-7% slower)."""
    B, H, M, _ = q.shape
    N = k.shape[2] if table is None else mask.shape[-1]
    if splits is None:  # (causal: its query blocks are programs too, and at most WINDOW_RANGES ranges: one merge)
        blocks = 1 if causal is None else -(-M // CAUSAL_QUERY_BLOCK)
        splits = splits_for(B * blocks, H, N, target, block_n)
        splits = splits if causal is None else min(WINDOW_RANGES, splits)
    per = -(-(-(-N // splits)) // block_n) * block_n  # keys per split, whole blocks
    S = max(1, -(-N // per))
    out = torch.empty(B, H, S, M, v.shape[3], device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H, S, M, device=q.device, dtype=torch.float32)
    if causal is not None:  # one launch: its query blocks are a grid dimension
        assert not (trigger or linked), "split_attention: a causal window launches on its own (no trigger, no link)"
        _launch(q, k, v, mask, scale, table, S, per, block_n, num_warps, num_stages, out,
                (out.stride(0), out.stride(1), out.stride(2), out.stride(3)), lse, causal=causal)
        return out, lse
    step = MAX_QUERIES[q.dtype == torch.float32]
    for m in range(0, M, step):  # (queries are independent: a group larger than one tile runs in slices)
        o = out[:, :, :, m:m + step]
        _launch(q[:, :, m:m + step], k, v, mask, scale, table, S, per, block_n, num_warps, num_stages, o,
                (o.stride(0), o.stride(1), o.stride(2), o.stride(3)), lse[..., m:m + step], trigger=trigger,
                linked=linked and m == 0)
    return out, lse


def split_attention_merged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                           o_pre: torch.Tensor, l_pre: torch.Tensor, G: int, dtype: torch.dtype, *,
                           table: torch.Tensor | None = None, block_n: int = BLOCK_N, num_warps: int | None = None,
                           num_stages: int = 2, after: bool = False, trigger: bool = False) -> torch.Tensor:
    """:func:`split_attention` over one key range per (entry, head) with
    :func:`~treerl.rollout.shared.merge_parts` in its epilogue: ``q/k/v/mask/table`` as there (the rows' own part, ``M = gq`` queries), ``o_pre
    [B/G, H, S2, G x gq, Dv]`` / ``l_pre`` the other part's key ranges (:func:`split_attention`'s
    outputs for the groups' queries) -> ``[B, 1, H x gq, Dv]`` in ``dtype``. No partials of the own
    part are written and no merge kernel runs (one launch a layer fewer). (128-key tiles: faster in
    ``bench/serve_attention.py`` on served rows of unequal length, slower on equal ones, and no
    change end to end: session 17 call 3.)

    ``after`` (CUDA, sm_90+; see :func:`overlap_ok`): the launch directly follows the
    :func:`split_attention` launch with ``trigger`` that writes ``o_pre``/``l_pre``, in the same
    stream, and is a programmatic dependent launch: its programs start while that one runs,
    read and attend their own keys (nothing that launch writes), and wait for it (``griddepcontrol.wait``)
    only before the merge reads its ranges. At 64 rows the two launches are each too short to
    fill the GPU (session 25, H200, 64 rows of 256 own keys after a 1,024-token prompt: 41.2 us a
    layer in turn, 37.5 overlapped). ``trigger`` (CUDA, sm_90+): each program first lets the next
    launch start beside this one, where that launch is dependent (the small tail's chain:
    :func:`~treerl.rollout.small_products.linear_partials` with ``pdl``)."""
    B, H, M, _ = q.shape
    N = k.shape[2] if table is None else mask.shape[-1]
    assert o_pre.shape[0] * G == B and o_pre.shape[1] == H and o_pre.shape[3] == G * M and o_pre.stride(-1) == 1
    out = torch.empty(B, 1, H * M, v.shape[3], device=q.device, dtype=dtype)
    per = -(-N // block_n) * block_n
    _launch(q, k, v, mask, scale, table, 1, per, block_n, num_warps, num_stages, out,
            (out.stride(0), out.stride(2), 0, 0), None, (o_pre, l_pre, G), trigger=trigger, after=after)
    return out


def merge_ranges(o_own: torch.Tensor, l_own: torch.Tensor, o_pre: torch.Tensor, l_pre: torch.Tensor, G: int,
                 dtype: torch.dtype, window: bool = False) -> torch.Tensor:
    """:func:`~treerl.rollout.shared.merge_parts` in one launch (where the own part runs in
    several key ranges: a few rows over long own keys; ~7 small kernels a layer there):
    ``o_own [B, H, S1, M, Dv]`` / ``l_own [B, H, S1, M]`` (:func:`split_attention`'s), ``o_pre
    [B/G, H, S2, G x M, Dv]`` / ``l_pre`` -> ``[B, 1, H x M, Dv]`` in ``dtype``. ``window``: a prefill
    window's merge (:func:`~treerl.rollout.window_attention.window_attention`, ``S1 <=
    WINDOW_RANGES``): one compiled kernel for any sizes."""
    B, H, S1, M, DV = o_own.shape
    S2 = o_pre.shape[2]
    assert o_pre.shape[0] * G == B and o_pre.shape[1] == H and o_pre.shape[3] == G * M
    assert o_own.stride(-1) == o_pre.stride(-1) == l_own.stride(-1) == l_pre.stride(-1) == 1
    out = torch.empty(B, 1, H * M, DV, device=o_own.device, dtype=dtype)
    assert (not window or S1 <= WINDOW_RANGES) and H * M < 65536, (S1, H, M)  # (CUDA's grid: y < 65,536)
    (_merge_kernel_any if window else _merge_kernel)[(B, H * M)](
        o_own, l_own, o_pre, l_pre, out, *o_own.stride()[:4], *l_own.stride()[:3], *o_pre.stride()[:4],
        *l_pre.stride()[:3], out.stride(0), out.stride(2), S1, S2, G, M,
        DV=DV, BLOCK_S1=WINDOW_RANGES if window else triton.next_power_of_2(S1), BLOCK_S2=max(1, triton.next_power_of_2(S2)), num_warps=1)
    return out


def _launch(q, k, v, mask, scale, table, S, per, block_n, num_warps, num_stages, out, out_strides, lse,
            merge=None, causal=None, trigger: bool = False, after: bool = False, linked: bool = False) -> None:
    """One launch of ``_split_kernel`` over ``(B x H, S)`` programs of ``per`` keys each (``causal``:
    ``(Q0, QW)``, and the queries in blocks of ``CAUSAL_QUERY_BLOCK``: a third grid dimension;
    ``trigger``/``after``: the overlap of :func:`split_attention_merged`; ``linked``: :func:`split_attention`'s)."""
    assert not after or merge is not None, "only the merged own part waits for the launch before it"
    B, H, M, D = q.shape
    DV = v.shape[3]
    mask = mask.reshape(mask.shape[0], mask.shape[-1]) if mask.dim() == 4 else mask
    if table is None:
        N, page, table = k.shape[2], 0, mask  # (any pointer: not read)
    else:
        N, page = mask.shape[-1], k.shape[2]
        assert table.shape[0] == B and table.shape[1] * page >= N and table.stride(1) == 1
    o2, l2, G2 = merge if merge is not None else (out, out, 1)  # (not read without a merge)
    lse = out if lse is None else lse  # (not written with a merge)
    block_m = max(16, triton.next_power_of_2(M))
    if causal is not None:
        block_m = min(block_m, CAUSAL_QUERY_BLOCK)
    assert S < 65536 and -(-M // block_m) < 65536, (S, M, block_m)  # (CUDA's grid: y, z < 65,536)
    (_split_kernel_any if causal is not None else _split_kernel)[(B * H, S, -(-M // block_m))](
        q, k, v, mask, out, lse, table, o2, l2,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0), table.stride(0),
        *out_strides, lse.stride(0), lse.stride(1), lse.stride(2) if lse.dim() > 2 else 0,
        *((o2.stride(0), o2.stride(1), o2.stride(2), o2.stride(3), l2.stride(0), l2.stride(1), l2.stride(2),
           o2.shape[2]) if merge is not None else (0,) * 8), G2,
        H, M, N, per, scale, float(torch.finfo(mask.dtype).min), *(causal if causal is not None else (0, 1)),
        BLOCK_M=block_m, BLOCK_N=block_n, D=D, DV=DV, IEEE=q.dtype == torch.float32, PAGE=page,
        MASK_CHUNK=CAUSAL_MASK_CHUNK if causal is not None else min(1024, max(16, triton.next_power_of_2(per))),
        MERGE=merge is not None,
        CAUSAL=causal is not None, TRIGGER=trigger, WAIT=after, LINKED=linked,
        num_warps=num_warps or (4 if block_m <= 32 else 8), num_stages=num_stages,
        **({"launch_pdl": True} if after or linked else {}),  # (a compile option: only where it is used)
    )


def to_pages(k: torch.Tensor, v: torch.Tensor, page: int,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense keys/values ``[B, H, N, D]`` (``N`` a multiple of ``page``) as block pools
    ``[B x N / page + 1, H, page, D]`` (blocks in a random order; the last block zeros) and
    their table ``[B, N / page]``: the paged own store's layout, for checks and tests."""
    B, H, N, _ = k.shape
    n = N // page
    order = torch.randperm(B * n, generator=generator, device=k.device)

    def pages(x: torch.Tensor) -> torch.Tensor:
        pool = x.new_zeros(B * n + 1, H, page, x.shape[3])
        raw(pool)[order] = raw(x.reshape(B, H, n, page, x.shape[3]).transpose(1, 2).reshape(B * n, H, page, x.shape[3]))
        return pool

    return pages(k), pages(v), order.reshape(B, n)


@functools.lru_cache(maxsize=None)
def split_attention_ok(device: str, dtype: torch.dtype, head_dim: int, value_dim: int, page: int = 0,
                       kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel runs here and agrees with float64 math (probed once per device,
    dtype, head sizes and, with ``page``, also on keys paged in blocks of ``page`` slots;
    ``kv_dtype``: keys/values stored in that dtype (float8), queries in ``dtype``; never
    inside a capture; a failure warns, :func:`~treerl.rollout.kernel_probe.kernel_agrees`)."""
    if triton is None or not device.startswith("cuda") or dtype == torch.float64 or head_dim % 16 or value_dim % 16:
        return False
    kv_dtype = kv_dtype or dtype

    def check() -> bool:
        g = torch.Generator(device=device).manual_seed(0)
        N = 200  # keys (a partial last tile); paged: in whole blocks, the last one partly attended
        n = N if page == 0 else -(-N // page) * page
        q = torch.randn(3, 2, 5, head_dim, device=device, dtype=dtype, generator=g)
        k = stored(torch.randn(3, 2, n, head_dim, device=device, dtype=dtype, generator=g), kv_dtype)
        v = stored(torch.randn(3, 2, n, value_dim, device=device, dtype=dtype, generator=g), kv_dtype)
        mask = torch.zeros(3, N, device=device, dtype=dtype)
        mask[1, 20:] = torch.finfo(dtype).min
        s = torch.matmul(q.double(), k[:, :, :N].double().transpose(-1, -2)) * 0.125 + mask.double()[:, None, None, :]
        ref = torch.matmul(torch.softmax(s, -1), v[:, :, :N].double())
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        runs = [split_attention(q, k[:, :, :N], v[:, :, :N], mask, 0.125, splits=3)]
        if page:
            pk, pv, table = to_pages(k, v, page, g)
            runs.append(split_attention(q, pk, pv, mask, 0.125, splits=3, table=table))
        for out, lse in runs:
            o = (torch.softmax(lse.double(), dim=2)[..., None] * out.double()).sum(2)
            if not (torch.allclose(o, ref, atol=tol) and torch.allclose(torch.logsumexp(lse.double(), 2),
                                                                        torch.logsumexp(s, -1), atol=tol)):
                return False
        return True

    return kernel_agrees(check, what="the split-key decode attention kernel", reference="float64 attention",
                         where=f"{device} ({dtype}, K/V {kv_dtype}, head {head_dim}/{value_dim}, page {page})",
                         fallback="the decode attention runs through CUDA's memory-efficient kernel or plain "
                                  "math (slower)")


@functools.lru_cache(maxsize=None)
def overlap_ok(device: str, dtype: torch.dtype, head_dim: int, value_dim: int,
               kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the prompt part's launch and the merged own part after it overlap here
    (:func:`split_attention` with ``trigger``, :func:`split_attention_merged` with ``after``:
    programmatic dependent launch, CUDA sm_90+) and give the bits of the two launches run in
    turn (probed once per device, dtype and head sizes, on a prompt part far longer than the own
    part, so that the own programs reach their merge while its ranges are still being written;
    never inside a capture; a failure warns, :func:`~treerl.rollout.kernel_probe.kernel_agrees`)."""
    if (triton is None or not device.startswith("cuda") or torch.cuda.get_device_capability(device)[0] < 9
            or getattr(getattr(tl.extra, "cuda", None), "gdc_wait", None) is None  # (Triton >= 3.3)
            or not split_attention_ok(device, dtype, head_dim, value_dim, 0, kv_dtype)):
        return False
    kv_dtype = kv_dtype or dtype

    def check() -> bool:
        g = torch.Generator(device=device).manual_seed(0)
        groups, G, H, gq, P, L, page = 4, 4, 2, 2, 8192, 40, 64

        def randn(*shape, kv=False):
            x = torch.randn(*shape, device=device, dtype=dtype, generator=g)
            return stored(x, kv_dtype) if kv else x

        q_pre, pk, pv = randn(groups, H, G * gq, head_dim), randn(groups, H, P, head_dim, kv=True), \
            randn(groups, H, P, value_dim, kv=True)
        q_own = randn(groups * G, H, gq, head_dim)  # (the own part paged, as the decode step runs it)
        ok, ov, table = to_pages(randn(groups * G, H, page, head_dim, kv=True),
                                 randn(groups * G, H, page, value_dim, kv=True), page, g)
        p_mask, o_mask = torch.zeros(groups, P, device=device, dtype=dtype), torch.zeros(groups * G, page,
                                                                                          device=device, dtype=dtype)
        o_mask[:, L:] = torch.finfo(dtype).min

        def pair(overlapped: bool):
            o_pre, l_pre = split_attention(q_pre, pk, pv, p_mask, 0.125, trigger=overlapped)
            return split_attention_merged(q_own, ok, ov, o_mask, 0.125, o_pre, l_pre, G, dtype, table=table,
                                          after=overlapped), o_pre

        want = pair(False)[0]
        for _ in range(3):  # (eager: the launches run and agree; only the replays below can show a missing wait)
            if not torch.equal(pair(True)[0], want):
                return False
        graph = torch.cuda.CUDAGraph()  # (the decode step runs it captured: the dependent launch as a graph edge)
        with torch.cuda.graph(graph):
            got, o_pre = pair(True)
        for _ in range(3):
            o_pre.fill_(float("nan"))  # (a merge that read the prompt part's ranges before they were written: NaN)
            graph.replay()
            if not torch.equal(got, want):
                return False
        return True

    return kernel_agrees(check, what="the decode attention's overlapped launches", reference="the same launches in turn",
                         where=f"{device} ({dtype}, K/V {kv_dtype}, head {head_dim}/{value_dim})",
                         fallback="the prompt part and the own part run one after the other")
