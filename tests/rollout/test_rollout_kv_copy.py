"""The K/V slot copy kernel (treerl.rollout.kv_copy): dense and paged stores, against torch
indexing; and the two stores that use it (an admitted row's own blocks, a finished row's kept
context) equal to their indexing paths. Runs under Triton's interpreter (TRITON_INTERPRET=1)
on the CPU and on a CUDA GPU; skipped elsewhere."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")
triton = pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _i64(*a) -> torch.Tensor:
    return torch.tensor(a, device=DEV, dtype=torch.int64)


def _paged_slot(pool: torch.Tensor, table: torch.Tensor, r: int, j: int) -> torch.Tensor:
    page = pool.shape[3]
    return pool[:, table[r, j // page], :, j % page]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_slots_dense_to_paged_and_back(dtype):
    """Rows of different counts and starts (partial tiles and blocks, a count of 0), dense ->
    paged through a table -> dense: every copied slot equal bit for bit, nothing else written."""
    from treerl.rollout.kv_copy import copy_slots

    g = torch.Generator(device=DEV).manual_seed(3)
    L, H, D, page = 3, 2, 16, 16
    dense = torch.randn(L, 5, H, 90, D, device=DEV, generator=g).to(dtype)
    pool = torch.full((L, 20, H, page, D), -7.0, device=DEV, dtype=dtype)
    table = torch.randperm(19, device=DEV, generator=g)[:18].reshape(3, 6)
    src_rows, starts, counts = [4, 0, 2], [7, 0, 50], [70, 33, 0]
    copy_slots(dense, pool, _i64(*src_rows), _i64(*starts), _i64(0, 1, 2), _i64(0, 0, 0), _i64(*counts), 70,
               dst_table=table)
    written = set()
    for r, (sr, s0, n) in enumerate(zip(src_rows, starts, counts)):
        for j in range(n):
            assert torch.equal(_paged_slot(pool, table, r, j), dense[:, sr, :, s0 + j]), (r, j)
            written.add((int(table[r, j // page]), j % page))
    for b in range(20):  # untouched slots keep their fill
        for o in range(page):
            if (b, o) not in written:
                assert (pool[:, b, :, o] == -7.0).all(), (b, o)
    back = torch.zeros(L, 3, H, 80, D, device=DEV, dtype=dtype)
    copy_slots(pool, back, _i64(0, 1), _i64(0, 5), _i64(2, 0), _i64(10, 0), _i64(70, 28), 70, src_table=table)
    assert torch.equal(back[:, 2, :, 10:80], dense[:, 4, :, 7:77])
    assert torch.equal(back[:, 0, :, :28], dense[:, 0, :, 5:33])
    assert (back[:, 2, :, :10] == 0).all() and (back[:, 1] == 0).all()


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_copy_slots_converts_as_the_store_holds(dst_dtype):
    """A copy into a store of another dtype rounds each value as ``rollout.types.stored`` does
    (float8: saturated at 448), and back out widens it exactly."""
    from treerl.rollout.kv_copy import copy_slots
    from treerl.rollout.types import stored

    if DEV == "cpu":
        pytest.skip("Triton's interpreter rounds conversions its own way (truncating to bf16); checked on the GPU")
    src = torch.randn(2, 1, 1, 40, 8, device=DEV) * 300
    dst = torch.zeros(2, 1, 1, 40, 8, device=DEV, dtype=dst_dtype)
    copy_slots(src, dst, _i64(0), _i64(0), _i64(0), _i64(0), _i64(40), 40)
    assert torch.equal(dst.float(), stored(src, dst_dtype).float())
    back = torch.zeros_like(src)
    copy_slots(dst, back, _i64(0), _i64(0), _i64(0), _i64(0), _i64(40), 40)
    assert torch.equal(back, dst.float())


def _store(block=16, blocks=16, rows=3, max_blocks=5):
    from treerl.rollout.shared import SharedPrefixCache

    g = torch.Generator().manual_seed(1)
    table = torch.randperm(blocks, generator=g)[: rows * max_blocks].reshape(rows, max_blocks).to(DEV)
    table[2, 3:] = blocks  # a row with fewer blocks: the rest name the trash block
    return SharedPrefixCache(2, rows, 1, 64, table, blocks, block, 2, 16, 16, torch.float32, torch.device(DEV),
                             forks=[(1, 64, 1)])


@pytest.mark.parametrize("where", ["own", "prefix", 0])
def test_load_through_the_kernel_equals_the_indexing_path(monkeypatch, where):
    """SharedPrefixCache.load into the own blocks, the prompt store and a fork level: the kernel
    path leaves every slot an entry holds (up to the prefill's end) equal to the advanced-indexing
    path's."""
    import treerl.rollout.shared as shared
    from treerl.rollout.kv import SlotCache

    g = torch.Generator().manual_seed(2)
    L, B, H, C, D = 2, 4, 2, 60, 16
    src = SlotCache(L, C)
    src.attach(torch.randn(L, B, H, C, D, generator=g).to(DEV), torch.randn(L, B, H, C, D, generator=g).to(DEV))
    src.length = C
    dst, rows, start, n = _i64(0, 2, 1), _i64(3, 0, 1), _i64(5, 20, 40), 45
    got = []
    for ok in (False, True):
        monkeypatch.setattr(shared, "copy_slots_ok", lambda *a, ok=ok: ok)
        store = _store()
        store.load(src, where, dst, rows, start, n)
        got.append(store)
    want, new = got
    for i, (d, s0) in enumerate(zip(dst.tolist(), start.tolist())):
        held = min(n, C - s0)  # (past the prefill's end the indexing path writes copies of its last slot: masked)
        assert held > 0
        for j in range(held):
            if where == "own":
                blk = int(want.table[d, j // 16])
                pairs = ((a[:, blk, :, j % 16], b[:, blk, :, j % 16])
                         for a, b in ((want.all_ok, new.all_ok), (want.all_ov, new.all_ov)))
            else:
                stores = ((want.all_pk, new.all_pk), (want.all_pv, new.all_pv)) if where == "prefix" else (
                    (want.all_fk[0], new.all_fk[0]), (want.all_fv[0], new.all_fv[0]))
                pairs = ((a[:, d, :, j], b[:, d, :, j]) for a, b in stores)
            for x, y in pairs:
                assert torch.equal(x, y), (i, j)


def test_kept_context_through_the_kernel_equals_the_indexing_path(monkeypatch):
    import treerl.rollout.kept_contexts as kept

    store = _store()
    g = torch.Generator().manual_seed(4)
    store.all_ok.copy_(torch.randn(store.all_ok.shape, generator=g))
    store.all_ov.copy_(torch.randn(store.all_ov.shape, generator=g))
    blocks = store.table[1].cpu().numpy()
    out = []
    for ok in (False, True):
        monkeypatch.setattr(kept, "copy_slots_ok", lambda *a, ok=ok: ok)
        out.append(kept.own_context(store, np.asarray(blocks), 70))
    for a, b in zip(*out):
        assert a.shape == b.shape == (2, 2, 70, 16) and torch.equal(a, b)
