"""The paged own store of the continuous-batching stream (CPU, float64, tiny random Qwen3):
rows own only the K/V blocks they write; with a K/V budget far below the worst case, groups
are preempted (whole groups, whole trees) and readmitted with their K/V recomputed, and
greedy samples still equal a per-prompt full forward, token by token and logprob by
logprob, every sample delivered once; with a weight update between, every token keeps the
version of the weights that produced it. The block allocator's accounting (no block lost or
shared), and the split-key kernel reading keys through a block table (Triton; run on CPU
with ``TRITON_INTERPRET=1``, else on a GPU)."""

from __future__ import annotations

import copy
import os
from itertools import product

import numpy as np
import pytest
import torch

from helpers.models import tiny_model
from helpers.reference import completion_logprobs
from helpers.rollout import greedy_reference as _greedy_reference, long_target_length, random_prompts, sampling
from treerl.rollout import PromptQueue, RolloutEngine, SamplingParams, ForkLayout
from treerl.rollout.kv import rollout_attention_enabled
from treerl.rollout.paging import BlockTable
from treerl.rollout.stream import RunningBatch

MAX_NEW = 40


def params(**kw) -> SamplingParams:
    return sampling(MAX_NEW, length=long_target_length, **{"n": 3, **kw})


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def greedy_reference(model, prompt, max_new=MAX_NEW):
    return _greedy_reference(model, prompt, max_new, length=long_target_length)


def check_greedy(model, groups, prompts, p: SamplingParams, refs: dict):
    """Every prompt's group once, with exactly its branches; every completion equals the
    prompt's greedy full-forward reference, logprobs to 1e-9."""
    assert sorted(g.prompt_index for g in groups) == list(range(len(prompts)))
    for g in groups:
        prompt = prompts[g.prompt_index]
        ref = refs.setdefault(g.prompt_index, greedy_reference(model, prompt))
        passed = [f for t, f in p.branch_schedule().items() if len(ref) > t]
        assert [c.branch for c in g] == list(product(range(p.n), *(range(f) for f in passed))), g.prompt_index
        lp = completion_logprobs(model, prompt, ref)
        for c in g:
            assert c.prompt_ids.tolist() == prompt
            assert c.completion_ids.tolist() == ref, (g.prompt_index, c.branch)
            assert c.finish_reason == ("stop" if long_target_length(ref) <= MAX_NEW else "length")
            assert torch.allclose(c.logprobs, lp, rtol=1e-9, atol=1e-12), (c.logprobs - lp).abs().max()


@pytest.fixture(scope="module")
def refs():
    return {}  # greedy references by prompt index (the prompts below are the same in every test)


PROMPTS = random_prompts([7, 1, 13, 4, 10, 3, 9, 16, 5, 12], seed=24)  # completions of 4..40 tokens


@pytest.mark.parametrize("static_kv", [False, True], ids=["sliced-kv", "static-kv"])
@pytest.mark.parametrize("sync_every", [1, 4])
def test_preempted_groups_equal_per_prompt_full_forward(model, refs, static_kv, sync_every):
    """n=3, blocks of 16 own slots (3 per row at most), a budget of 12 blocks for 4 group
    slots that could fill 36: groups are preempted again and again, and every sample still
    equals the full forward and comes out exactly once."""
    p = params()
    engine = RolloutEngine(model, static_kv=static_kv, sync_every=sync_every, kv_block_size=16,
                           max_batch_tokens=4 * 16 + 12 * 16)
    groups = list(engine.generate_stream(PROMPTS, p))
    lengths = [len(refs.setdefault(i, greedy_reference(model, q))) for i, q in enumerate(PROMPTS)]
    assert max(lengths) > 32 and min(lengths) < 16, lengths  # rows of 1..3 blocks
    check_greedy(model, groups, PROMPTS, p, refs)
    s = engine.stats
    assert s.preemptions > 0 and s.kv_slots == 4 * 16 + 12 * 16
    assert s.generated_tokens == 3 * sum(lengths)


@pytest.mark.parametrize("static_kv", [False, True], ids=["sliced-kv", "static-kv"])
def test_preempted_trees_equal_per_prompt_full_forward(model, refs, static_kv):
    """Tree rollouts (forks at 2 and 5, 8 leaves per tree) with too few blocks: whole trees
    are preempted (before, between and after their forks) and readmitted; every leaf equals
    the full forward, every branch comes out once."""
    p = params(n=2, branch_points=[2, 5], branch_factor=[2, 2])
    tree = ForkLayout.of(p)
    shared = tree.shared_tokens(16)
    budget = 3 * (shared + tree.rows * 16)  # 3 trees of one block per leaf: 24 blocks (they may fill 72)
    engine = RolloutEngine(model, static_kv=static_kv, sync_every=3, kv_block_size=16, max_batch_tokens=budget)
    groups = list(engine.generate_stream(PROMPTS, p))
    check_greedy(model, groups, PROMPTS, p, refs)
    assert engine.stats.preemptions > 0 and engine.stats.forks > 0


def test_preemption_with_a_weight_update_keeps_versions(refs):
    """Weights change while groups are preempted and running: a preempted group is
    recomputed under the weights of its readmission; every token records the version that
    produced it, and each logprob equals a full forward of that version on the same prefix."""
    a, b = tiny_model(seed=0), tiny_model(seed=7)
    prompts = random_prompts([9, 4, 15, 6, 11, 2, 13, 8], seed=22)
    engine = RolloutEngine(copy.deepcopy(a), version=0, sync_every=2, kv_block_size=16,
                           max_batch_tokens=4 * 16 + 12 * 16)
    groups, before = [], 0
    for g in engine.generate_stream(prompts, params()):
        groups.append(g)
        if engine.stats.preemptions and engine.version == 0:  # the first group out after a preemption
            before = engine.stats.preemptions
            engine.update_weights(b)
    assert before > 0 and engine.version == 1, "no preemption before the update"
    assert sorted(g.prompt_index for g in groups) == list(range(len(prompts)))
    switched = 0
    for g in groups:
        prompt = prompts[g.prompt_index]
        assert [c.branch for c in g] == [(0,), (1,), (2,)]
        for c in g:
            ids = c.completion_ids.tolist()
            k = int((c.versions == 0).sum())
            assert c.versions.tolist() == [0] * k + [1] * (len(ids) - k)
            switched += 0 < k < len(ids)
            assert len(ids) == min(long_target_length(ids), MAX_NEW)
            assert torch.allclose(c.logprobs[:k], completion_logprobs(a, prompt, ids[:k]), rtol=1e-9, atol=1e-12)
            assert torch.allclose(c.logprobs[k:], completion_logprobs(b, prompt + ids[:k], ids[k:]),
                                  rtol=1e-9, atol=1e-12)
            with torch.no_grad():  # greedy under the version of each token
                for t in range(len(ids)):
                    m = a if t < k else b
                    assert int(m(torch.tensor([prompt + ids[:t]])).logits[0, -1].argmax()) == ids[t]
    assert switched >= 2


@pytest.mark.parametrize("tree", [False, True], ids=["plain", "tree"])
def test_hf_forward_path_under_preemption(model, refs, tree):
    """The decode step through the model's HF forward (what families treerl does not run
    itself use: ``SharedPrefixCache.update`` writes through the block table and returns the
    gathered own keys), with preemption and forks: greedy equals the full forward."""
    p = params(n=2, branch_points=[2, 5], branch_factor=[2, 2]) if tree else params()
    layout = ForkLayout.of(p)
    engine = RolloutEngine(model, static_kv=True, sync_every=2, kv_block_size=16,
                           max_batch_tokens=3 * (layout.shared_tokens(16) + layout.rows * 16))
    engine.decode_blocks = None
    groups = list(engine.generate_stream(PROMPTS, p))
    check_greedy(model, groups, PROMPTS, p, refs)
    assert engine.stats.preemptions > 0


def test_block_accounting_no_leak(model):
    """Through a stream with preemptions, forks, finished rows and compaction: at every
    group it yields, each block is free or owned by one row, live rows own the blocks their
    own tokens fill, idle rows own none; at the end every block is free."""
    p = params(n=2, branch_points=[5], branch_factor=2)
    engine = RolloutEngine(model, sync_every=3, kv_block_size=16, max_batch_tokens=400)
    tree = ForkLayout.of(p)
    batch = RunningBatch(engine, PromptQueue(PROMPTS, close=True), p, torch.Generator().manual_seed(0), 4, 16,
                         engine.max_batch_tokens)
    assert batch.blocks.num_blocks < 4 * tree.rows * batch.max_blocks  # overcommitted
    seen = []
    with rollout_attention_enabled(engine.model), torch.no_grad():
        for g in batch.run():
            seen.append(g.prompt_index)
            h = batch.host
            t = h.blocks
            t.check()
            own = np.clip(h.fed_h - tree.own_start, 0, None)
            assert (t.missing(np.arange(h.S), own)[h.live] == 0).all()
            assert (t.owned[~h.live] == 0).all()
            assert (batch.dev.table.cpu().numpy() == t.table).all() or t.dirty
    assert sorted(seen) == list(range(len(PROMPTS))) and engine.stats.preemptions > 0
    batch.blocks.check()
    assert batch.blocks.free == batch.blocks.num_blocks


def test_group_larger_than_the_budget_runs_alone(model, refs):
    """A budget below one group's worst case: one group slot whose pool holds that group's
    worst case (over the budget, by its own needs only); nothing is preempted."""
    p = params()
    engine = RolloutEngine(model, sync_every=2, kv_block_size=16, max_batch_tokens=50)
    groups = list(engine.generate_stream(PROMPTS[:3], p))
    check_greedy(model, groups, PROMPTS[:3], p, refs)
    assert engine.stats.preemptions == 0 and engine.stats.kv_slots == 16 + 3 * 48


def test_block_table():
    t = BlockTable(rows=4, max_blocks=3, num_blocks=5, block_size=16)
    assert t.trash == 5 and t.free == 5
    assert t.grow(np.array([0, 2]), np.array([17, 1]))  # row 0: 2 blocks, row 2: 1
    assert t.owned.tolist() == [2, 0, 1, 0] and t.free == 2 and t.table[0].tolist() == [0, 1, 5]
    assert not t.grow(np.array([1, 3]), np.array([48, 1]))  # 4 wanted, 2 free: nothing changes
    assert t.owned.tolist() == [2, 0, 1, 0] and t.free == 2
    assert t.missing(np.array([0, 1]), np.array([40, 20])).tolist() == [1, 2]
    t.move(np.array([1]), np.array([0]))
    assert t.owned.tolist() == [0, 2, 1, 0] and t.table[0].tolist() == [5, 5, 5] and t.table[1].tolist() == [0, 1, 5]
    t.release(np.array([1]))
    t.check()
    assert t.free == 4 and t.grow(np.array([3]), np.array([48])) and t.table[3].tolist() == [0, 1, 3]
    t.check()
    t.upload(dev := torch.zeros(4, 3, dtype=torch.int64))
    assert (dev.numpy() == t.table).all() and not t.dirty


# ------------------------------------------------------------------ the kernel through a block table
def _triton_runs() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - CPU-only installs
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _kernel_dtypes():
    if torch.cuda.is_available():
        return [torch.bfloat16, torch.float16, torch.float32]
    return [torch.float32, torch.float16]  # (the interpreter's bf16 dot is broken)


@pytest.mark.skipif(not _triton_runs(), reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("page", [64, 16, 48, 128])
@pytest.mark.parametrize("dtype", _kernel_dtypes(), ids=str)
def test_split_kernel_reads_own_keys_through_the_block_table(page, dtype):
    """The split-key kernel over a block pool (blocks in random order, trash block and
    unowned entries included) equals exact attention over the row's dense keys, with the
    two-level merge, or with the merge in its epilogue (``split_attention_merged``); through
    :meth:`SharedPrefixCache.attend_own` too."""
    from treerl.rollout.decode_attention import split_attention, split_attention_merged, to_pages
    from treerl.rollout.shared import SharedPrefixCache, merge_parts, split_queries, two_level_attention

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(page)
    NG, G, Hkv, gq, D, P = 2, 3, 2, 2, 32, 70
    L = 2 * page if page < 128 else 128  # own slots attended: several blocks, or part of one
    B, Hq = NG * G, Hkv * gq

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float64)

    q, pk, pv = rnd(B, Hq, 1, D), rnd(NG, Hkv, P, D), rnd(NG, Hkv, P, D)
    cap = -(-L // page) * page + page  # one more block than attended: unowned (trash) entries
    ok, ov = rnd(B, Hkv, cap, D), rnd(B, Hkv, cap, D)
    olen = torch.randint(1, L + 1, (B,), generator=g, device=dev)
    plen = torch.tensor([P, 9], device=dev)

    def masks(dt):
        zero, neg = torch.zeros((), dtype=dt, device=dev), torch.tensor(torch.finfo(dt).min, dtype=dt, device=dev)
        om = torch.where(torch.arange(L, device=dev)[None] < olen[:, None], zero, neg)[:, None, None]
        pm = torch.where(torch.arange(P, device=dev)[None] < plen[:, None], zero, neg)[:, None, None]
        return om, pm

    c = [t.to(dtype) for t in (q, ok, ov, pk, pv)]
    r = [t.double() for t in c]
    om64, pm64 = masks(torch.float64)
    ref = two_level_attention(r[0], r[1][:, :, :L], r[2][:, :, :L], om64, r[3], r[4], pm64, D ** -0.5, G)
    om, pm = masks(dtype)
    pool_k, pool_v, table = to_pages(c[1], c[2], page, g)
    table[:, -1] = pool_k.shape[0] - 1  # the last block of every row: the trash block
    q_own, q_pre = split_queries(c[0], Hkv, G)
    o_own, l_own = split_attention(q_own, pool_k, pool_v, om, D ** -0.5, table=table)
    o_pre, l_pre = split_attention(q_pre, c[3], c[4], pm, D ** -0.5)
    out = merge_parts(o_own, l_own, o_pre, l_pre, G, dtype)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
    assert (out.double() - ref).abs().max() <= tol
    # the merge in the own part's epilogue (one launch for the own part and the merge): paged, dense, and with
    # the prompt part in the rows' layout (G = 1, as tree rollouts' fork levels leave it)
    merged = split_attention_merged(q_own, pool_k, pool_v, om, D ** -0.5, o_pre, l_pre, G, dtype, table=table)
    assert merged.shape == out.shape and merged.dtype == dtype and (merged.double() - ref).abs().max() <= tol
    merged = split_attention_merged(q_own, c[1][:, :, :L], c[2][:, :, :L], om, D ** -0.5, o_pre, l_pre, G, dtype)
    assert (merged.double() - ref).abs().max() <= tol
    o_rows, l_rows = split_attention(q_own, *(x.repeat_interleave(G, 0) for x in (c[3], c[4])),
                                     pm.repeat_interleave(G, 0), D ** -0.5, splits=3)
    merged = split_attention_merged(q_own, pool_k, pool_v, om, D ** -0.5, o_rows, l_rows, 1, dtype, table=table)
    assert (merged.double() - ref).abs().max() <= tol
    # the cache's own part: split kernel and the gathered fallback agree
    cache = SharedPrefixCache(1, NG, G, P, table, pool_k.shape[0] - 1, page, Hkv, D, D, dtype, torch.device(dev))
    cache.layers[0].ok, cache.layers[0].ov = pool_k, pool_v
    cache.own_len = L
    for backend in ("split", "math"):
        o, lse = cache.attend_own(0, q_own, om, D ** -0.5, backend)
        out = merge_parts(o, lse, o_pre, l_pre, G, dtype)
        assert (out.double() - ref).abs().max() <= tol, backend


@pytest.mark.skipif(not _triton_runs(), reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype", [d for d in _kernel_dtypes() if d != torch.float32], ids=str)
@pytest.mark.parametrize("page", [64, 128, 48])
def test_merged_kernel_in_wide_key_tiles(dtype, page):
    """The merged kernel in 128-key tiles (``bench/serve_attention.py``'s variant) over a long span: over
    blocks of 64 slots (two table entries a tile), of 128 (one) and of 48 (a lookup per key), rows of
    unequal length (one shorter than a tile, one a key past a tile, a dead slot), merged with a prompt part
    in 2 ranges (one empty): equal to float64 attention over each row's dense keys merged by ``merge_parts``."""
    from treerl.rollout.decode_attention import split_attention_merged, to_pages
    from treerl.rollout.shared import _attend_math, merge_parts

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(page)
    B, G, H, M, D = 6, 2, 2, 2, 32
    N = -(-1124 // page) * page
    q = torch.randn(B, H, M, D, generator=g, device=dev).to(dtype)
    k = torch.randn(B, H, N, D, generator=g, device=dev).to(dtype)
    v = torch.randn(B, H, N, D, generator=g, device=dev).to(dtype)
    lens = torch.tensor([N, 1, 129, N - 37, 700, 0], device=dev)  # (0: a dead slot, its output not checked)
    mask = torch.where(torch.arange(N, device=dev)[None] < lens[:, None], 0.0, torch.finfo(dtype).min).to(dtype)
    o2 = torch.randn(B // G, H, 2, G * M, D, generator=g, device=dev)
    l2 = torch.randn(B // G, H, 2, G * M, generator=g, device=dev)
    l2[0, :, 1] = float("-inf")
    o1, l1 = _attend_math(q.double(), k.double(), v.double(), mask.double()[:, None, None], D ** -0.5)
    want = merge_parts(o1.unsqueeze(2), l1.unsqueeze(2), o2.double(), l2.double(), G, torch.float64)
    pk, pv, table = to_pages(k, v, page, g)
    got = split_attention_merged(q, pk, pv, mask, D ** -0.5, o2, l2, G, dtype, table=table, block_n=128)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    assert (got.double() - want)[:-1].abs().max() <= tol


@pytest.mark.skipif(not _triton_runs(), reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B, G, H, M, S1, S2, Dv", [(6, 3, 2, 2, 4, 3, 16), (1, 1, 8, 2, 5, 1, 128),
                                                   (4, 1, 3, 1, 1, 2, 64), (8, 4, 2, 3, 7, 5, 32),
                                                   (1, 1, 2, 2, 66, 1, 128)])  # (one row over ~4k keys)
def test_merge_ranges_equals_merge_parts(dtype, B, G, H, M, S1, S2, Dv):
    """The own part's key ranges merged with the prompt part's in one kernel
    (``decode_attention.merge_ranges``, where the own part runs in several ranges) equals
    ``merge_parts`` (float64 through it: to 1e-12), empty ranges (LSE -inf) included."""
    from treerl.rollout.decode_attention import merge_ranges
    from treerl.rollout.shared import merge_parts

    if dtype == torch.float64 and torch.cuda.is_available():
        pytest.skip("float64: the interpreter's check (CUDA runs the kernel's own dtypes)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(B + S1)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    o_own = torch.randn(B, H, S1, M, Dv, generator=g, device=dev, dtype=acc)
    l_own = torch.randn(B, H, S1, M, generator=g, device=dev, dtype=acc) * 3
    o_pre = torch.randn(B // G, H, S2, G * M, Dv, generator=g, device=dev, dtype=acc)
    l_pre = torch.randn(B // G, H, S2, G * M, generator=g, device=dev, dtype=acc) * 3
    l_pre[0, 0, -1] = float("-inf")  # a range with no keys
    if S1 > 1:
        l_own[-1, -1, 0] = float("-inf")
    want = merge_parts(o_own, l_own, o_pre, l_pre, G, dtype)
    got = merge_ranges(o_own, l_own, o_pre, l_pre, G, dtype)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert got.shape == want.shape == (B, 1, H * M, Dv) and got.dtype == dtype
    assert torch.allclose(got.double(), want.double(), rtol=tol, atol=tol), (got.double() - want.double()).abs().max()


@pytest.mark.skipif(not _triton_runs(), reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("page", [0, 64, 16], ids=["dense", "page64", "page16"])
def test_split_kernel_reads_no_key_past_a_rows_last_visible_key(page):
    """The split kernel stops at each split's last visible key (rows shorter than the step's
    span): NaN K/V in every tile past it leaves the output equal to float64 math on the
    visible keys, dense and through a block table; a range past a row's last visible key reads
    nothing and has LSE -inf (the first range always reads its first tile: finite); a hidden
    run inside a row and partial tiles stay exact; one split per row gives the row's
    log-sum-exp."""
    from treerl.rollout.decode_attention import split_attention, to_pages

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(5)
    B, H, M, N, D = 5, 2, 3, 512, 16
    q, k, v = (torch.randn(B, H, n, D, generator=g, device=dev) for n in (M, N, N))
    lens = torch.tensor([64, 100, 512, 1, 300], device=dev)
    neg = torch.finfo(torch.float32).min
    mask = torch.where(torch.arange(N, device=dev)[None] < lens[:, None], 0.0, neg)
    mask[4, 70:200] = neg  # a hidden run inside a row (read, finite)
    s = (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5 + mask.double()[:, None, None, :]
    ref = torch.softmax(s, -1) @ v.double()
    for b, n in enumerate(lens.tolist()):  # every tile after the one holding the row's last key: poisoned
        start = max(-(-n // 64) * 64, 64)
        k[b, :, start:], v[b, :, start:] = float("nan"), float("nan")
    kk, vv, table = (k, v, None) if page == 0 else to_pages(k, v, page, g)
    for splits in (1, 3, None):
        out, lse = split_attention(q, kk, vv, mask, D ** -0.5, splits=splits, table=table)
        o = (torch.softmax(lse.double(), dim=2)[..., None] * out.double()).sum(2)
        assert torch.isfinite(o).all(), splits
        assert (o - ref).abs().max() <= 1e-5, splits
        if splits == 1:
            assert (lse[:, :, 0].double() - torch.logsumexp(s, -1)).abs().max() <= 1e-5
        if splits == 3:  # ranges of 192 keys: [0, 192), [192, 384), [384, 512)
            empty = torch.tensor([[r > 0 and 192 * r >= n for r in range(3)] for n in lens.tolist()], device=dev)
            assert empty.sum() == 7 and (lse.isneginf().all(3).all(1) == empty).all()
            assert torch.isfinite(lse[~empty[:, None, :].expand(-1, H, -1)]).all()


@pytest.mark.skipif(not _triton_runs(), reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")
def test_prompt_part_programs_set_its_key_ranges():
    """``attend_with_lse``'s ``target`` (the kernel step passes ``blocks.PROMPT_PROGRAMS``, the prompt
    part's setting): the split kernel's ranges are those :func:`splits_for` gives for it, and the merged
    output equals float64 attention whatever the count of ranges."""
    from treerl.rollout import blocks
    from treerl.rollout.decode_attention import BLOCK_N, splits_for
    from treerl.rollout.shared import attend_with_lse

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(3)
    B, H, M, N, D = 2, 2, 4, 512, 16  # 4 (group, head) pairs of 512 keys
    q, k, v = (torch.randn(B, H, n, D, generator=g, device=dev) for n in (M, N, N))
    mask = torch.zeros(B, 1, 1, N, device=dev)
    mask[1, ..., 300:] = torch.finfo(torch.float32).min
    s = (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5 + mask.double()
    ref = torch.softmax(s, -1) @ v.double()
    assert blocks.PROMPT_PROGRAMS >= 132  # (at least one program an SM of an H100/H200)
    for target, ranges in ((8, 2), (16, 4), (blocks.PROMPT_PROGRAMS, N // BLOCK_N)):
        out, lse = attend_with_lse(q, k, v, mask, D ** -0.5, "split", target=target)
        assert out.shape[2] == lse.shape[2] == ranges == splits_for(B, H, N, target), target
        o = (torch.softmax(lse.double(), dim=2)[..., None] * out.double()).sum(2)
        assert (o - ref).abs().max() <= 1e-5, target
