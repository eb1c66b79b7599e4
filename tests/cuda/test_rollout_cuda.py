"""The rollout engine's CUDA paths (CUDA graphs, compiled decode blocks, the decode attention
kernels, K/V memory) against the eager engine and a float64 full forward. Skipped on machines
without a GPU; run on the device machine (``pytest -m cuda``). Their CPU counterparts live in
tests/rollout/ (the section of each file is named)."""

import copy

import pytest
import torch

from helpers.models import tiny_model
from helpers.reference import completion_logprobs
from helpers.rollout import VOCAB, long_target_length, random_prompts, sampling
from treerl.models import build_model, rmsnorm_in_input_precision
from treerl.rollout import ForkLayout, PromptQueue, RolloutEngine, SamplingParams
from treerl.rollout import race_kernel as rk
from treerl.rollout.race_kernel import race_kernel
from treerl.rollout.sampling import _kernel_ok, draw_seeds, race_reference, race_sample

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def assert_float64_logprobs(model, prompted_groups, temperature: float = 1.0) -> None:
    """Every completion's logprobs (``prompted_groups``: ``(prompt, group)`` pairs) equal a
    float64 full forward of ``model`` (RMSNorm in the input precision) to 2e-4."""
    reference = rmsnorm_in_input_precision(copy.deepcopy(model).cpu().double())
    for prompt, g in prompted_groups:
        for c in g:
            ref = completion_logprobs(reference, prompt, c.completion_ids.tolist(), temperature)
            assert torch.allclose(c.logprobs.double(), ref, atol=2e-4), (c.logprobs - ref).abs().max()



# ------------------------------------------------------------------ generate (tests/rollout/test_rollout.py)


def test_cuda_graph_decode_matches_full_forward():
    model = tiny_model(dtype=torch.float32, seed=2).cuda()
    prompts = random_prompts([9, 30, 3, 17], seed=6)
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_new_tokens=40, seed=0,
                            branch_points=[10], stop_token_ids=list(range(0, VOCAB, 41)))
    torch.backends.cuda.matmul.allow_tf32 = False
    graphed = RolloutEngine(model, sync_every=4)
    assert graphed.cuda_graphs and graphed.static_kv
    groups = graphed.generate(prompts, params)
    greedy = SamplingParams(temperature=0, max_new_tokens=20)
    eager = RolloutEngine(model, cuda_graphs=False).generate(prompts, greedy)
    for g, e, p in zip(graphed.generate(prompts, greedy), eager, prompts):
        assert g[0].completion_ids.tolist() == e[0].completion_ids.tolist()
    assert graphed.stats.decode_steps > 0 and sum(len(g) for g in groups) > len(prompts) * 3
    assert_float64_logprobs(model, zip(prompts, groups), 0.8)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_cuda_bf16_pending_logits_sample_as_a_float32_copy_would(temperature):
    """A bf16 model's decode steps (CUDA graphs, the kernel step) write their logits in bf16 through the
    head's own product; sampled against a float32 buffer of the head's output (the path before session 24):
    the same tokens, logprobs to float32 rounding, and a float64 full forward's logprobs to bf16's accuracy."""
    model = tiny_model(dtype=torch.bfloat16, seed=2, head_dim=128, num_attention_heads=4,
                       num_key_value_heads=2).cuda()
    prompts = random_prompts([9, 30, 3, 17], seed=6)
    params = SamplingParams(n=4, temperature=temperature, max_new_tokens=24, seed=3)
    runs = []
    for pending in (None, torch.float32):
        engine = RolloutEngine(copy.deepcopy(model))
        assert engine.cuda_graphs and engine.pending_logit_dtype == torch.bfloat16
        if pending is not None:
            engine.pending_logit_dtype = pending
        runs.append(engine.generate(prompts, params))
        assert engine.stats.decode_steps > 0
    for g16, g32 in zip(*runs):
        for a, b in zip(g16, g32):
            assert a.completion_ids.tolist() == b.completion_ids.tolist()
            assert torch.allclose(a.logprobs, b.logprobs, atol=1e-6), (a.logprobs - b.logprobs).abs().max()


# ------------------------------------------------------------------ the stream (tests/rollout/test_rollout_stream.py)


def test_cuda_graph_stream_matches_eager_and_full_forward():
    """CUDA graphs per row bucket, admissions into graphed batches, compaction: greedy
    equals the eager stream; sampled logprobs match a float64 full forward."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(dtype=torch.float32, seed=2).cuda()
    prompts = random_prompts([9, 30, 3, 17, 5, 12, 21, 2, 8, 14], seed=6)
    graphed = RolloutEngine(model, sync_every=4)
    assert graphed.cuda_graphs and graphed.static_kv
    eager = RolloutEngine(model, cuda_graphs=False)
    a = sorted(graphed.generate_stream(prompts, sampling(24, n=2), max_rows=12), key=lambda g: g.prompt_index)
    b = sorted(eager.generate_stream(prompts, sampling(24, n=2), max_rows=12), key=lambda g: g.prompt_index)
    assert [[c.completion_ids.tolist() for c in g] for g in a] == [[c.completion_ids.tolist() for c in g] for g in b]
    assert graphed.stats.admissions > 1
    p = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_new_tokens=40, seed=0,
                       stop_token_ids=list(range(0, VOCAB, 41)))
    groups = list(graphed.generate_stream(prompts, p, max_rows=24))
    assert_float64_logprobs(model, ((prompts[g.prompt_index], g) for g in groups), 0.8)


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float32, 16), (torch.float16, 64)])
def test_cuda_two_level_attention_kernel(dtype, D):
    """The CUDA memory-efficient kernel and treerl's split-key Triton kernel (with LSE) are
    usable here, and two-level attention through each agrees with the exact float64
    reference to the dtype's rounding; so does the split kernel reading the own keys
    through a block table (paged row store, blocks of 64 and 16 slots)."""
    from treerl.rollout.decode_attention import split_attention_ok
    from treerl.rollout.shared import _efficient_ok, two_level_attention

    dev = "cuda"
    assert _efficient_ok(str(torch.device(dev, torch.cuda.current_device())), dtype, D, D), "fast path not usable"
    assert split_attention_ok(str(torch.device(dev, torch.cuda.current_device())), dtype, D, D), "split kernel not usable"
    # views of unaligned lengths (eager steps) may or may not run on the kernel: reported, not required
    print("unaligned lengths on the kernel:", _efficient_ok(str(torch.device(dev, torch.cuda.current_device())),
                                                            dtype, D, D, True))
    g = torch.Generator(device=dev).manual_seed(0)
    NG, G, Hkv, gq, P, L = 4, 8, 2, 2, 1040, 96
    B, Hq = NG * G, Hkv * gq

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float64)

    q, pk, pv, ok, ov = rnd(B, Hq, 1, D), rnd(NG, Hkv, P, D), rnd(NG, Hkv, P, D), rnd(B, Hkv, L, D), rnd(B, Hkv, L, D)
    plen = torch.tensor([1040, 500, 1, 77], device=dev)
    olen = torch.randint(1, L + 1, (B,), generator=g, device=dev)

    def masks(dt):
        zero, neg = torch.zeros((), dtype=dt, device=dev), torch.tensor(torch.finfo(dt).min, dtype=dt, device=dev)
        pm = torch.where(torch.arange(P, device=dev)[None] < plen[:, None], zero, neg)[:, None, None]
        om = torch.where(torch.arange(L, device=dev)[None] < olen[:, None], zero, neg)[:, None, None]
        return om, pm

    om, pm = masks(dtype)
    c = [t.to(dtype) for t in (q, ok, ov, pk, pv)]
    r = [t.double() for t in c]  # float64 reference on the same (rounded) inputs
    om64, pm64 = masks(torch.float64)
    ref = two_level_attention(r[0], r[1], r[2], om64, r[3], r[4], pm64, D ** -0.5, G)
    slow = two_level_attention(c[0], c[1], c[2], om, c[3], c[4], pm, D ** -0.5, G, backend="math")
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
    assert (slow.double() - ref).abs().max() <= tol
    for backend in ("efficient", "split"):
        out = two_level_attention(c[0], c[1], c[2], om, c[3], c[4], pm, D ** -0.5, G, backend=backend)
        assert (out.double() - ref).abs().max() <= tol, backend
        assert (out.double() - slow.double()).abs().max() <= tol, backend
    # the own part read through a block table (the paged row store; blocks in random order)
    from treerl.rollout.decode_attention import split_attention, to_pages
    from treerl.rollout.shared import merge_parts, split_queries

    for page in (64, 16):
        assert split_attention_ok(str(torch.device(dev, torch.cuda.current_device())), dtype, D, D, page)
        pad = -L % page
        pool_k, pool_v, table = to_pages(torch.nn.functional.pad(c[1], (0, 0, 0, pad)),
                                         torch.nn.functional.pad(c[2], (0, 0, 0, pad)), page, g)
        q_own, q_pre = split_queries(c[0], Hkv, G)
        o_own, l_own = split_attention(q_own, pool_k, pool_v, om, D ** -0.5, table=table)
        o_pre, l_pre = split_attention(q_pre, c[3], c[4], pm, D ** -0.5)
        out = merge_parts(o_own, l_own, o_pre, l_pre, G, dtype)
        assert (out.double() - ref).abs().max() <= tol, page


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float32, 16)])
def test_cuda_split_kernel_skips_hidden_tiles(dtype, D):
    """The split kernel does not read a key tile whose keys the mask hides (rows shorter than
    the step's span): NaN K/V in such tiles (not the first range's first tile) leaves the output equal to
    float64 math on the visible keys; a hole inside a row and partial tiles stay exact."""
    from treerl.rollout.decode_attention import split_attention, split_attention_ok

    dev = "cuda"
    assert split_attention_ok(str(torch.device(dev, torch.cuda.current_device())), dtype, D, D)
    g = torch.Generator(device=dev).manual_seed(3)
    B, H, M, N = 6, 2, 4, 2048
    q, k, v = (torch.randn(B, H, n, D, generator=g, device=dev).to(dtype) for n in (M, N, N))
    lens = torch.tensor([64, 100, 2048, 1, 700, 1500], device=dev)
    neg = torch.finfo(dtype).min
    mask = torch.where(torch.arange(N, device=dev)[None] < lens[:, None], 0.0, neg).to(dtype)
    mask[4, 200:300] = neg  # a hidden run inside a row
    s = (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5 + mask.double()[:, None, None, :]
    ref = torch.softmax(s, -1) @ v.double()
    for b, n in enumerate(lens.tolist()):  # whole hidden tiles after each row's first tile: poisoned
        start = max(-(-n // 64) * 64, 64)
        k[b, :, start:], v[b, :, start:] = float("nan"), float("nan")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for splits in (1, 4, None):
        out, lse = split_attention(q, k, v, mask, D ** -0.5, splits=splits)
        o = (torch.softmax(lse.double(), dim=2)[..., None] * out.double()).sum(2)
        assert torch.isfinite(o).all(), splits
        assert (o - ref).abs().max() <= tol, splits
        if splits == 1:  # one split per row: its LSE is the row's
            assert (lse[:, :, 0].double() - torch.logsumexp(s, -1)).abs().max() <= tol


@pytest.mark.parametrize("n", [2, 1], ids=["groups", "own-prompts"])
@pytest.mark.parametrize("compile_decode", [False, True], ids=["graphs", "compiled+graphs"])
def test_cuda_graph_stream_kept_buffers_prefix_cache(compile_decode, n):
    """CUDA graphs per (group slots, own slots) bucket, reused by a second stream through
    keep_stream_buffers, prefix-cache hits, compaction; optionally compiled (decode and
    prefill blocks); ``n = 1``: prompts in the rows' own blocks (read by the split kernel
    through the block table), and turn 2 extends turn 1's kept contexts (prompt +
    completion): greedy equals the eager stream and float32 logprobs equal a float64 full
    forward to 2e-4 (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(dtype=torch.float32, seed=2).cuda()
    prompts = random_prompts([9, 30, 3, 17, 5, 12, 21, 2, 8, 14], seed=6)
    graphed = RolloutEngine(model, sync_every=4, keep_stream_buffers=True, compile_decode=compile_decode,
                            prefix_cache_tokens=4096)
    eager = RolloutEngine(model, cuda_graphs=False, prefix_cache_tokens=4096)
    key = lambda gs: [[c.completion_ids.tolist() for c in g] for g in sorted(gs, key=lambda g: g.prompt_index)]  # noqa: E731
    a = list(graphed.generate_stream(prompts, sampling(24, n=n), max_rows=8))
    b = list(eager.generate_stream(prompts, sampling(24, n=n), max_rows=8))
    assert key(a) == key(b)
    # n = 1: the rows kept prompt + completion (kept_contexts; the prompts' own entries superseded), and turn 2
    # shares their first blocks; the kept K/V is the decode steps' own (graphs, split kernel), checked below
    assert graphed.stats.contexts_kept == eager.stats.contexts_kept == (len(prompts) if n == 1 else 0)
    turn2 = [p + [1, 2, 3] for p in prompts] if n == 2 else [
        p + g[0].completion_ids.tolist() + [1, 2, 3] for p, g in zip(prompts, sorted(a, key=lambda g: g.prompt_index))]
    c = list(graphed.generate_stream(turn2, sampling(24, n=n), max_rows=8))  # same shapes: buffers, graphs reused
    assert key(c) == key(eager.generate_stream(turn2, sampling(24, n=n), max_rows=8))
    hits = sum(len(p) for p in prompts) if n == 2 else sum(len(t) - 4 for t in turn2)
    assert graphed.stats.prefix_cache_hit_tokens == eager.stats.prefix_cache_hit_tokens == hits
    if compile_decode:
        assert graphed.decode_blocks.compiled and graphed.prefiller.forward.pre.compiled, "not compiled"
    assert graphed.stats.prefill_graph_calls > 0 and graphed.prefiller.graphs.use_graphs, graphed.stats
    assert_float64_logprobs(model, ((turn2[g.prompt_index], g) for g in c))


@pytest.mark.parametrize("compile_decode", [False, True], ids=["eager-blocks", "compiled-blocks"])
def test_cuda_prefill_graphs_replay_new_inputs(compile_decode):
    """Small prefills replayed as CUDA graphs (treerl.rollout.prefill_graphs): prefix-cache
    hits and misses, one bucket replayed with other sequences, another bucket in between
    (the buckets share their K/V buffers): each sequence's K/V and last logits equal the
    exact-shape prefill of the eager engine (float32, TF32 off), and a graph is captured
    once per bucket."""
    from treerl.rollout.kv import rollout_attention_enabled
    from treerl.rollout.prefix_cache import PrefixEntry

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(dtype=torch.float32, seed=2).cuda()
    graphed = RolloutEngine(model, compile_decode=compile_decode)
    exact = RolloutEngine(model, cuda_graphs=False, compile_decode=False)
    assert graphed.prefill_graph_tokens == 2048 and exact.prefill_graph_tokens == 0

    def entry(s, c):
        with rollout_attention_enabled(model), torch.no_grad():
            cache, _, logits = exact.prefiller([s[:c]], None)
        C = cache.length
        return PrefixEntry(tuple(s[:c]), cache.all_keys[:, 0, :, C - c:].clone(),
                           cache.all_values[:, 0, :, C - c:].clone(), logits[0].clone(), 0)

    rounds = [(random_prompts([20, 9, 31], seed=40), [7, 0, 30]),
              (random_prompts([90, 3], seed=41), [0, 0]),  # another bucket
              (random_prompts([25, 14, 30], seed=42), [24, 3, 16])]  # the first bucket again, other contents
    for seqs, cut in rounds:
        cached = [entry(s, c) if c else None for s, c in zip(seqs, cut)]
        with rollout_attention_enabled(model), torch.no_grad():
            got_cache, _, got = graphed.prefiller(seqs, cached, graphed.stats)
            ref_cache, _, ref = exact.prefiller(seqs, cached)
            torch.cuda.synchronize()
        G, R = got_cache.length, ref_cache.length
        for i, s in enumerate(seqs):
            n = len(s)
            assert torch.allclose(got[i], ref[i], atol=1e-4, rtol=1e-4), (got[i] - ref[i]).abs().max()
            assert torch.allclose(got_cache.all_keys[:, i, :, G - n:], ref_cache.all_keys[:, i, :, R - n:], atol=1e-4)
            assert torch.allclose(got_cache.all_values[:, i, :, G - n:], ref_cache.all_values[:, i, :, R - n:],
                                  atol=1e-4)
    s = graphed.stats
    assert s.prefill_graph_calls == 3 and s.prefill_graph_builds == 2 and graphed.prefiller.graphs.use_graphs, s


def test_cuda_prompt_kv_memory_is_stored_once():
    """4 prompts of 1000 tokens x G=16 (64 rows): the running batch's K/V slots are one prompt
    store per group + the rows' own tokens (not rows x (prompt + new)), and peak memory
    follows: far below what per-row prompt copies would need."""
    model = build_model("qwen3", "small", dtype=torch.bfloat16, seed=1).cuda()
    prompts = random_prompts([1000] * 4, seed=3)
    engine = RolloutEngine(model, sync_every=8)
    params = SamplingParams(n=16, temperature=1.0, max_new_tokens=32, seed=0)
    list(engine.generate_stream(prompts[:1], params))  # warm-up: the decode blocks compile (not K/V memory)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    # the prefill's own transient (attention over 4 x 1000 tokens) is no K/V storage: measured alone
    torch.cuda.reset_peak_memory_stats()
    list(engine.generate_stream(prompts, SamplingParams(n=1, max_new_tokens=1)))
    prefill = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    groups = list(engine.generate_stream(prompts, params))
    assert len(groups) == 4 and all(len(c) == 32 for g in groups for c in g)
    assert engine.stats.kv_slots == 4 * (1008 + 16 * 32)
    per_token = model.config.num_hidden_layers * model.config.num_key_value_heads * 2 * 32 * 2
    copies = 64 * (1000 + 32) * per_token  # what per-row prompt copies alone would take (~135 MB)
    assert torch.cuda.max_memory_allocated() - base - prefill < copies / 2


def test_cuda_graphs_survive_streams_that_keep_no_buffers():
    """Streams one after another without keep_stream_buffers (the trainer's way) each capture
    their graphs into a pool of their own: no allocator assert, no fallback to eager, and the
    greedy samples equal an eager engine's."""
    model = tiny_model(dtype=torch.float32, seed=7).cuda()
    graphed, eager = RolloutEngine(model, sync_every=4), RolloutEngine(model, cuda_graphs=False)
    key = lambda gs: [[c.completion_ids.tolist() for c in g] for g in gs]  # noqa: E731
    for seed in range(3):
        prompts = random_prompts([9, 30, 3, 17], seed=seed)
        assert key(graphed.generate(prompts, sampling(24, n=2))) == key(eager.generate(prompts, sampling(24, n=2)))
        assert graphed.cuda_graphs, "capture failed: decoding fell back to eager"


# ------------------------------------------------------------------ tree rollouts (tests/rollout/test_rollout_forks.py)


@pytest.mark.parametrize("compile_decode", [False, True], ids=["graphs", "compiled+graphs"])
def test_cuda_graph_trees_match_eager_and_full_forward(compile_decode):
    """Tree rollouts with CUDA graphs (optionally compiled decode blocks): greedy equals the
    eager stream; sampled float32 logprobs equal a float64 full forward to 2e-4 (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(dtype=torch.float32, seed=2).cuda()
    prompts = random_prompts([9, 30, 3, 17, 5, 12], seed=6)
    p = sampling(20, n=2, branch_points=[3, 9], branch_factor=[2, 3])
    graphed = RolloutEngine(model, sync_every=4, compile_decode=compile_decode)
    eager = RolloutEngine(model, cuda_graphs=False, compile_decode=False)
    key = lambda gs: sorted((g.prompt_index, [(c.branch, c.completion_ids.tolist()) for c in g]) for g in gs)  # noqa: E731
    assert key(graphed.generate_stream(prompts, p, max_rows=2 * p.max_leaves)) == \
        key(eager.generate_stream(prompts, p, max_rows=2 * p.max_leaves))
    sampled = SamplingParams(n=2, temperature=0.8, max_new_tokens=24, seed=0, branch_points=[4, 10],
                             branch_factor=2, stop_token_ids=list(range(0, VOCAB, 41)))
    groups = graphed.generate(prompts, sampled)
    if compile_decode:
        assert graphed.decode_blocks.compiled, "compilation fell back to eager"
    assert all(len(g) >= 2 for g in groups)
    assert_float64_logprobs(model, zip(prompts, groups), 0.8)


# ------------------------------------------------------------------ the paged own store (tests/rollout/test_rollout_paging.py)


@pytest.mark.parametrize("tree", [False, True], ids=["plain", "tree"])
def test_cuda_graphs_under_preemption(tree):
    """CUDA graphs and compiled decode blocks (the split kernel reading own keys through the
    block table, updated in place between replays) with groups preempted again and again:
    greedy equals an eager engine with room for everything, float32 logprobs equal a
    float64 full forward to 2e-4 (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(dtype=torch.float32, seed=3).cuda()
    prompts = random_prompts([7, 1, 13, 4, 10, 3, 9, 16, 5, 12], seed=24)  # completions of 4..40 tokens
    p = sampling(40, length=long_target_length, n=2, branch_points=[2, 5], branch_factor=[2, 2]) if tree \
        else sampling(40, length=long_target_length, n=3)
    layout = ForkLayout.of(p)
    graphed = RolloutEngine(model, sync_every=4, kv_block_size=16,
                            max_batch_tokens=3 * (layout.shared_tokens(16) + layout.rows * 16))
    eager = RolloutEngine(model, cuda_graphs=False, compile_decode=False)
    key = lambda gs: sorted((g.prompt_index, [(c.branch, c.completion_ids.tolist()) for c in g]) for g in gs)  # noqa: E731
    groups = list(graphed.generate_stream(prompts, p))
    assert key(groups) == key(eager.generate_stream(prompts, p))
    assert graphed.stats.preemptions > 0 and graphed.cuda_graphs and eager.stats.preemptions == 0
    assert graphed.decode_blocks.compiled, "compilation fell back to eager"
    assert_float64_logprobs(model, ((prompts[g.prompt_index], g) for g in groups))


# ------------------------------------------------------------------ per-group settings (tests/rollout/test_rollout_requests.py)


def test_cuda_per_group_settings_and_seeds():
    """On CUDA (graphed decode steps, sampling outside the graphs): mixed per-group settings
    in one batch; greedy groups equal the eager engine's; a seeded group's samples are the
    same alone and among other groups; logprobs match a float64 full forward."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(dtype=torch.float32, seed=2).cuda()
    ref = tiny_model(dtype=torch.float64, seed=2)
    prompts = random_prompts([9, 30, 3, 17, 5, 12], seed=46)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=24, n=2, seed=11, top_logprobs=2)
    per = [SamplingParams(temperature=0, max_new_tokens=20), seeded,
           SamplingParams(temperature=1.1, top_k=30, min_p=0.01, max_new_tokens=32, n=3),
           SamplingParams(temperature=0, max_new_tokens=8, n=2), SamplingParams(temperature=0.6, max_new_tokens=40),
           SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)]
    graphed = RolloutEngine(model, sync_every=4)
    assert graphed.cuda_graphs
    groups = graphed.generate(prompts, per)
    eager = RolloutEngine(model, cuda_graphs=False)
    for i in (0, 3):
        [alone] = eager.generate([prompts[i]], per[i])
        assert [c.completion_ids.tolist() for c in groups[i]] == [c.completion_ids.tolist() for c in alone]
    q = PromptQueue()
    q.put(prompts[1], params=seeded)
    q.close()
    [alone] = RolloutEngine(model, sync_every=4).generate_stream(q, SamplingParams(n=2, max_new_tokens=24))
    assert [c.completion_ids.tolist() for c in groups[1]] == [c.completion_ids.tolist() for c in alone]
    for g, p, prompt in zip(groups, per, prompts):
        for c in g:
            assert len(c) == p.max_new_tokens
            lp = completion_logprobs(ref, prompt, c.completion_ids.tolist(), temperature=p.temperature or 1.0)
            assert torch.allclose(c.logprobs.double(), lp, rtol=1e-4, atol=1e-4)
    assert groups[1][0].top_logprobs[0].shape == (24, 2) and groups[0][0].top_logprobs is None


# ------------------------------------------------------------ sampling (tests/rollout/test_rollout_sampling.py)


@pytest.mark.parametrize("rows, vocab, dtype", [(1, 151_936, torch.float32), (64, 151_936, torch.float32),
                                                (1024, 151_936, torch.float32), (64, 32_000, torch.bfloat16),
                                                (7, 1_000, torch.float32)])
def test_cuda_race_kernel_matches_the_reference(rows, vocab, dtype):
    """The one-pass race (Triton) against the torch reference on the same device: the same
    tokens (greedy, hot and cold rows, one temperature for all and per row), logprobs to
    float32 accuracy, written into given outputs; and its draws follow softmax(x / T)."""
    assert _kernel_ok("cuda:0")
    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(dtype)
    per_row = torch.tensor([0.0, 1.0, 0.6, 1.7], device="cuda").repeat(rows)[:rows]
    for t in (per_row, torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")):
        seeds = draw_seeds(rows, g, logits.device)
        want_tok, want_lp = race_reference(logits.float(), t, seeds)
        tokens, logp = torch.empty(rows, dtype=torch.int64, device="cuda"), torch.empty(rows, device="cuda")
        tok, lp = race_sample(logits, t, seeds, tokens, logp)
        assert tok is tokens and lp is logp
        assert (tok != want_tok).sum() <= max(1, rows // 500), (tok != want_tok).sum()  # float32 near-ties only
        same = tok == want_tok
        assert torch.allclose(lp[same], want_lp[same], atol=2e-4), (lp - want_lp).abs().max()
    n = 20_000
    small = torch.tensor([[0.3, -0.2, 0.9, 0.1, -3.0]], device="cuda").repeat(n, 1)
    draws = race_kernel(small, torch.tensor([0.8], device="cuda"), draw_seeds(n, g, small.device))[0]
    freq = torch.bincount(draws, minlength=5).double().cpu() / n
    expected = torch.softmax(small[0].double().cpu() / 0.8, -1)
    assert torch.all((freq - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt()), (freq, expected)


if rk.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _noise_bits(Out, Ref, N, LOW, BLOCK: tl.constexpr):
        """The race's noise for hashes whose top 23 bits are ``b`` (one a lane) and whose other bits are ``LOW``,
        beside ``tl.log``'s."""
        b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = b < N
        tl.store(Out + b, rk._gumbel_of_hash((b.to(tl.uint64) << 41) | LOW), mask=ok)
        u = (b.to(tl.float32) * 2.0 + 1.0) * 5.9604644775390625e-08
        tl.store(Ref + b, -tl.log(-tl.log(u)), mask=ok)

    @triton.jit
    def _lse_bits(X, OutM, OutS, FTZ: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        """The race's running max and sum of exponentials over ``X [STEPS, BLOCK]``, one lane a column."""
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for k in tl.static_range(STEPS):
            m, s = rk._lse_step(tl.load(X + k * BLOCK + lanes), m, s, FTZ)
        tl.store(OutM + lanes, m)
        tl.store(OutS + lanes, s)


@pytest.mark.skipif(rk.triton is None, reason="needs triton")
def test_cuda_race_noise_has_the_references_bits_for_every_hash():
    """The race's noise from a hash's top 23 bits (``race_kernel._gumbel_of_hash``: libdevice's log without its
    special cases) for every one of the 2^23 values equals ``tl.log``'s and torch's ``-log(-log u)`` bit for bit; and
    the running log-sum-exp through the flushing exp (``_lse_step`` with ``FTZ``) has the bits of ``tl.exp``'s
    over logits with -inf, ties and differences far below float32's smallest normal exponent."""
    n = 1 << 23
    u = (torch.arange(n, device="cuda", dtype=torch.float32) * 2 + 1) * 2.0**-24
    want = -torch.log(-torch.log(u))
    for low in (0, (1 << 41) - 1):  # the hash's bits below its top 23: none set, all set
        out, ref = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
        _noise_bits[(n // 1024,)](out, ref, n, low, BLOCK=1024)
        assert torch.equal(out, ref), (low, int((out != ref).sum()))
        assert torch.equal(out, want), (low, int((out != want).sum()))
    steps, block = 64, 1024
    g = torch.Generator(device="cuda").manual_seed(33)
    x = torch.randn(steps, block, device="cuda", generator=g) * 60  # differences of hundreds: subnormal exps
    x[0, :8] = float("-inf")
    x[:5, 8:16] = float("-inf")  # lanes whose first columns are masked
    x[:, 16:24] = x[0, 16:24]  # ties
    x[3, 24:32] = -120.0
    x[4, 24:32] = 0.0
    x[5, 24:32] = -100.0  # below the running max by more than 87 (e^-100 is subnormal in float32)
    got = [(torch.empty(block, device="cuda"), torch.empty(block, device="cuda")) for _ in range(2)]
    for ftz, (m, s) in zip((True, False), got):
        _lse_bits[(1,)](x, m, s, FTZ=ftz, BLOCK=block, STEPS=steps)
    assert torch.equal(got[0][0], got[1][0]), "running max"
    assert torch.equal(got[0][1], got[1][1]), ("sums", int((got[0][1] != got[1][1]).sum()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B, G, Hkv, gq, N, S2, Dv", [(64, 8, 8, 2, 512, 9, 128), (6, 1, 3, 1, 70, 3, 64),
                                                     (8, 2, 2, 4, 300, 1, 128), (1, 1, 8, 2, 4096, 40, 128)])
def test_cuda_merged_attention_matches_merge_parts(dtype, B, G, Hkv, gq, N, S2, Dv):
    """The own part in one key range merged in its kernel with the prompt part's ranges
    (``split_attention_merged``) against the own part in float64 merged by ``merge_parts``
    (a range with no keys has LSE -inf; rows of different lengths), dense and through a block table."""
    from treerl.rollout.decode_attention import split_attention_merged, to_pages
    from treerl.rollout.shared import _attend_math, merge_parts, merged_attention_ok

    assert merged_attention_ok("cuda:0", dtype, 128, Dv)
    g = torch.Generator(device="cuda").manual_seed(B + N)
    q = torch.randn(B, Hkv, gq, 128, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, N, 128, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, N, Dv, device="cuda", dtype=dtype, generator=g)
    lens = torch.randint(1, N + 1, (B,), device="cuda", generator=g)
    mask = torch.where(torch.arange(N, device="cuda")[None] < lens[:, None], 0.0, torch.finfo(dtype).min).to(dtype)
    mask = mask[:, None, None]
    o2 = torch.randn(B // G, Hkv, S2, G * gq, Dv, device="cuda", generator=g)
    l2 = torch.randn(B // G, Hkv, S2, G * gq, device="cuda", generator=g) * 3
    l2[0, 0, 0] = float("-inf")
    o1, l1 = _attend_math(q.double(), k.double(), v.double(), mask.double(), 128 ** -0.5)
    want = merge_parts(o1.unsqueeze(2), l1.unsqueeze(2), o2.double(), l2.double(), G, torch.float64)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    got = split_attention_merged(q, k, v, mask, 128 ** -0.5, o2, l2, G, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.allclose(got.double(), want, atol=tol), (got.double() - want).abs().max()
    if N % 64 == 0:
        pk, pv, table = to_pages(k, v, 64, g)
        got = split_attention_merged(q, pk, pv, mask, 128 ** -0.5, o2, l2, G, dtype, table=table)
        assert torch.allclose(got.double(), want, atol=tol), (got.double() - want).abs().max()


def _overlap_or_skip(dtype: torch.dtype, head_dim: int = 128) -> None:
    from treerl.rollout.decode_attention import overlap_ok

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    assert overlap_ok("cuda:0", dtype, head_dim, head_dim, dtype), "the overlap probe failed on an sm_90+ GPU"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("groups, G, P, L", [(8, 8, 1024, 300), (64, 16, 1024, 200), (2, 4, 16384, 17),
                                             (3, 1, 4096, 700)])
def test_cuda_overlapped_attention_equals_the_launches_in_turn(dtype, groups, G, P, L):
    """The prompt part's launch and the merged own part overlapped (programmatic dependent
    launch: the own programs start during the prompt part and wait for it only before their
    merge) give the bits of the two launches in turn: eager with the prompt part's outputs
    allocated over NaN-filled memory, and as CUDA graph replays with those outputs set to NaN
    before each replay (a merge that read them before the prompt part ended would give NaN)."""
    from treerl.rollout.decode_attention import split_attention, split_attention_merged, to_pages

    _overlap_or_skip(dtype)
    H, gq, D, page = 8, 2, 128, 64
    g = torch.Generator(device="cuda").manual_seed(groups + L)
    n = -(-L // page) * page
    q_pre = torch.randn(groups, H, G * gq, D, device="cuda", dtype=dtype, generator=g)
    pk = torch.randn(groups, H, P, D, device="cuda", dtype=dtype, generator=g)
    pv = torch.randn(groups, H, P, D, device="cuda", dtype=dtype, generator=g)
    p_mask = torch.zeros(groups, P, device="cuda", dtype=dtype)
    p_mask[0, P // 3:] = torch.finfo(dtype).min  # (a shorter prompt: ranges with no key)
    q_own = torch.randn(groups * G, H, gq, D, device="cuda", dtype=dtype, generator=g)
    ok, ov, table = to_pages(torch.randn(groups * G, H, n, D, device="cuda", dtype=dtype, generator=g),
                             torch.randn(groups * G, H, n, D, device="cuda", dtype=dtype, generator=g), page, g)
    lens = torch.randint(1, L + 1, (groups * G,), device="cuda", generator=g)
    o_mask = torch.where(torch.arange(n, device="cuda")[None] < lens[:, None], 0.0,
                         torch.finfo(dtype).min).to(dtype)
    scale = D ** -0.5

    def pair(overlap: bool):
        o_pre, l_pre = split_attention(q_pre, pk, pv, p_mask, scale, trigger=overlap)
        return split_attention_merged(q_own, ok, ov, o_mask, scale, o_pre, l_pre, G, dtype, table=table,
                                      after=overlap), o_pre, l_pre

    want, o_pre, l_pre = pair(False)
    shapes = (o_pre.shape, l_pre.shape)
    del o_pre, l_pre
    for _ in range(10):
        poison = [torch.full(s, float("nan"), device="cuda") for s in shapes]
        del poison  # (their blocks go back to the allocator, NaN-filled: the next outputs of these sizes get them)
        got, *_ = pair(True)
        assert torch.equal(got, want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pair(True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, o_pre, l_pre = pair(True)
    for _ in range(20):
        o_pre.fill_(float("nan"))
        l_pre.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, want)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_cuda_overlapped_decode_attention_in_the_engine(temperature, monkeypatch):
    """A bf16 rollout whose rows share their prompts (the kernel step, CUDA graphs) with the prompt
    part and the own part overlapped gives the tokens and logprobs, bit for bit, of the same rollout
    with them in turn."""
    import treerl.rollout.shared as shared

    _overlap_or_skip(torch.bfloat16)
    model = tiny_model(dtype=torch.bfloat16, seed=2, head_dim=128, num_attention_heads=4,
                       num_key_value_heads=2).cuda()
    prompts = random_prompts([9, 30, 3, 17], seed=6)
    params = SamplingParams(n=4, temperature=temperature, max_new_tokens=24, seed=3)
    seen = []
    merged = shared.split_attention_merged

    def spy(*args, after=False, **kwargs):
        if kwargs.get("table") is not None:  # (the decode steps' calls; a probe's run dense)
            seen.append(after)
        return merged(*args, after=after, **kwargs)

    monkeypatch.setattr(shared, "split_attention_merged", spy)
    overlapped = RolloutEngine(copy.deepcopy(model)).generate(prompts, params)
    assert seen and all(seen), "the engine's decode steps did not overlap the two parts"
    seen.clear()
    monkeypatch.setattr(shared, "overlap_ok", lambda *a, **k: False)
    in_turn = RolloutEngine(copy.deepcopy(model)).generate(prompts, params)
    assert seen and not any(seen)
    for ga, gb in zip(overlapped, in_turn):
        for a, b in zip(ga, gb):
            assert a.completion_ids.tolist() == b.completion_ids.tolist()
            assert torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_cuda_rope_write_matches_the_modules(family, dtype):
    """The decode step's fused Q/K norm + RoPE + K/V write kernel against the modules' math
    (``_pre``) in float64: queries in both layouts, the token's K/V and the pools' slots."""
    from treerl.rollout.block_probes import _rope_kernel_agrees
    from treerl.rollout.blocks import FusedProjections
    from treerl.rollout.layer_math import _heads, _pre, _qk_norms, _qkv
    from treerl.rollout.rope_kernel import rope_write

    model = tiny_model(family, dtype=dtype, seed=3, head_dim=128, num_attention_heads=4, num_key_value_heads=2).cuda()
    base, B, G = model.model, 12, 4
    ref = rmsnorm_in_input_precision(copy.deepcopy(model).double())
    hidden = torch.randn(B, 1, model.config.hidden_size, device="cuda", dtype=dtype)
    cos, sin = base.rotary_emb(hidden, torch.randint(0, 4000, (B, 1), device="cuda"))
    block, offset = torch.randperm(B, device="cuda"), torch.randint(0, 16, (B,), device="cuda")
    for i, layer in enumerate(base.layers):
        f, fr = FusedProjections(base.layers), FusedProjections(ref.model.layers)
        pools = [torch.zeros(B, 2, 16, 128, device="cuda", dtype=dtype) for _ in range(2)]
        want_pools = [p.double() for p in pools]
        want = _pre(ref.model.layers[i], hidden.double(), cos.double(), sin.double(), G, fr.qkv_w[i], fr.qkv_b[i],
                    *want_pools, block, offset)
        got = rope_write(_qkv(layer, hidden, f.qkv_w[i], f.qkv_b[i]), cos, sin, *_qk_norms(layer), *_heads(layer), G,
                         *pools, block, offset)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for a, b in list(zip(want, got)) + list(zip(want_pools, pools)):
            assert a.shape == b.shape and torch.allclose(b.double(), a, atol=tol * a.abs().max().item()), (a - b).abs().max()
        store = type("Store", (), {"ok": pools[0], "ov": pools[1]})
        assert _rope_kernel_agrees(layer, hidden, cos, sin, G, f.qkv_w[i], f.qkv_b[i], store)


# ------------------------------------------------------------------ small-row products (tests/rollout/test_small_products.py)


@pytest.mark.parametrize("rows", [1, 16, 64, 128])
def test_cuda_small_products_match_float64(rows):
    """The small-row product kernels on Qwen3-0.6B's product shapes after attention in bf16 and float32
    (IEEE products) against float64: the float32 partials' sum to 2e-5 and ``gated`` to 4 units of bf16's
    last place (float32: 2e-5), relative to the largest value."""
    from treerl.rollout import small_products as sp

    g = torch.Generator(device="cuda").manual_seed(rows)
    for dtype in (torch.bfloat16, torch.float32):
        tol = 4 * torch.finfo(dtype).eps if dtype != torch.float32 else 2e-5
        for N, K in ((1024, 2048), (6144, 1024), (1024, 3072)):
            x = torch.randn(rows, K, device="cuda", generator=g).to(dtype)
            w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
            ref = x.double() @ w.double().T
            parts = sp.linear_partials(x, w)
            assert parts.shape[0] == sp.splits_for(N, K, 32)
            err = (parts.double().sum(0) - ref).abs().max() / ref.abs().max()
            assert err <= 2e-5, (dtype, N, K, "partials", err.item())
            act = torch.nn.functional.silu(ref[:, :N // 2]) * ref[:, N // 2:]
            err = (sp.gated(x, w).double() - act).abs().max() / act.abs().max()
            assert err <= tol, (dtype, N, K, "gated", err.item())


@pytest.mark.parametrize("rows", [1, 64, 128])
def test_cuda_small_tail_chain_matches_float64_and_its_eager_bits(rows):
    """The block's tail as a chain of dependent launches (sm_90+) at Qwen3-0.6B's layer shape, bf16 and
    float32: against a float64 copy's tail, within twice the modules' own tail's error in that dtype; captured
    in a CUDA graph (as the step runs it) and replayed on three other inputs, each replay the bits of the
    chain run eagerly on that input (a link that read its input before the kernel before it had written
    it would give the previous replay's values)."""
    from treerl.rollout import small_products as sp
    from treerl.rollout.blocks import FusedProjections
    from treerl.rollout.layer_math import _residual_norm, _small_layer, _small_tail, _tail_norm

    if not sp.chains_here("cuda"):
        pytest.skip("the chain of dependent launches needs sm_90+")
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(rows)
    for dtype in (torch.bfloat16, torch.float32):
        model = tiny_model("qwen3", dtype=dtype, seed=4, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128).cuda()
        ref = rmsnorm_in_input_precision(copy.deepcopy(model).double())
        layer, following = model.model.layers[0], model.model.layers[1].input_layernorm
        f, fr = FusedProjections(model.model.layers), FusedProjections(ref.model.layers)
        weights = _small_layer(layer, f, 0)
        hidden = torch.randn(rows, 1, 1024, device="cuda", generator=g).to(dtype)
        attn = torch.randn(rows, 1, 2048, device="cuda", generator=g).to(dtype)

        def chain(h, a):
            return _small_tail(_residual_norm, layer, h, a, weights, following, chain=True)

        want = _tail_norm(ref.model.layers[0], hidden.double(), attn.double(), fr.gate_up_w[0], fr.gate_up_b[0],
                          fr.o_w[0], fr.down_w[0], ref.model.layers[1].input_layernorm)
        modules = _tail_norm(layer, hidden, attn, f.gate_up_w[0], f.gate_up_b[0], f.o_w[0], f.down_w[0], following)
        for a, b, c in zip(want, chain(hidden, attn), modules):
            err, own = (b.double() - a).abs().max().item(), (c.double() - a).abs().max().item()
            assert b.dtype == dtype and err <= 2 * own + 1e-6 * a.abs().max().item(), (dtype, err, own)
        h_in, a_in = hidden.clone(), attn.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(h_in, a_in)
        for scale in (-1.0, 0.5, 3.0):
            h_in.copy_(hidden * scale)
            a_in.copy_(attn.roll(1, 0) * scale)
            graph.replay()
            assert all(torch.equal(x, y) for x, y in zip(out, chain(h_in, a_in))), (dtype, scale)


@pytest.mark.parametrize("rows", [64, 128])
def test_cuda_qkv_link_matches_float64_and_its_eager_bits(rows):
    """The Q/K/V product and the rope kernel as links of the chain (sm_90+; ``layer_math._qkv_rope`` linked: the
    product's float32 partials summed in the rope kernel) at Qwen3-0.6B's layer shape, bf16 and float32: against a
    float64 copy's ``_pre`` within twice the modules' own error in that dtype (queries, the token's K/V, the pools);
    captured in a CUDA graph and replayed on three other inputs, each replay the bits of the links run eagerly on that
    input; and the engine's probe (``_qkv_link_agrees``) admits it."""
    from types import SimpleNamespace

    from treerl.rollout import small_products as sp
    from treerl.rollout.block_probes import _qkv_link_agrees
    from treerl.rollout.blocks import QKV_SPLITS, FusedProjections
    from treerl.rollout.layer_math import _pre, _qkv_rope

    if not sp.chains_here("cuda"):
        pytest.skip("the chain of dependent launches needs sm_90+")
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(rows)
    for dtype in (torch.bfloat16, torch.float32):
        model = tiny_model("qwen3", dtype=dtype, seed=4, hidden_size=1024, intermediate_size=3072, num_hidden_layers=1,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128).cuda()
        ref = rmsnorm_in_input_precision(copy.deepcopy(model).double())
        layer, G = model.model.layers[0], 8
        f, fr = FusedProjections(model.model.layers), FusedProjections(ref.model.layers)
        hidden = torch.randn(rows, 1, 1024, device="cuda", generator=g).to(dtype)
        cos, sin = model.model.rotary_emb(hidden, torch.randint(0, 4000, (rows, 1), device="cuda", generator=g))
        block, offset = torch.randperm(rows, device="cuda", generator=g), torch.randint(0, 64, (rows,), device="cuda",
                                                                                       generator=g)

        def pools(dt):
            return SimpleNamespace(ok=torch.zeros(rows, 8, 64, 128, device="cuda", dtype=dt),
                                   ov=torch.zeros(rows, 8, 64, 128, device="cuda", dtype=dt))

        x = layer.input_layernorm(hidden)
        want_p = pools(torch.float64)
        want = list(_pre(ref.model.layers[0], hidden.double(), cos.double(), sin.double(), G, fr.qkv_w[0], None,
                         want_p.ok, want_p.ov, block, offset)) + [want_p.ok, want_p.ov]

        def run(x_in, linked):
            p = pools(dtype)
            return list(_qkv_rope(layer, x_in, f.qkv_w[0], None, cos, sin, G, p, block, offset, linked,
                                   splits=QKV_SPLITS)) + [p.ok, p.ov]

        linked, in_turn = run(x, True), run(x, False)
        for a, b, c in zip(want, linked, in_turn):
            err, own = (b.double() - a).abs().max().item(), (c.double() - a).abs().max().item()
            assert b.dtype == c.dtype and err <= 2 * own + 1e-6 * a.abs().max().item(), (dtype, err, own)
        x_in = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(x_in, True)
        for scale in (-1.0, 0.5, 3.0):
            x_in.copy_(x.roll(1, 0) * scale)
            graph.replay()
            assert all(torch.equal(u, v) for u, v in zip(out, run(x_in, True))), (dtype, scale)
        assert _qkv_link_agrees(layer, x, f.qkv_w[0], cos, sin, G, pools(dtype), QKV_SPLITS)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_cuda_rope_write_rounds_the_partials_sum_as_the_product(splits):
    """``rope_write`` on the Q/K/V product's float32 partials in bf16: the bits of ``rope_write`` on their sum (in
    order, float32) rounded to bf16 first, as a bf16 product's output is (the rounding a float64 comparison cannot
    see, since skipping it is more accurate; the interpreter rounds float32 to bf16 unlike torch, so CUDA only)."""
    from treerl.rollout.layer_math import _heads, _qk_norms
    from treerl.rollout.rope_kernel import rope_write

    model = tiny_model("qwen3", dtype=torch.bfloat16, seed=6, hidden_size=512, num_hidden_layers=1,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=128).cuda()
    layer, B, G = model.model.layers[0], 64, 8
    g = torch.Generator(device="cuda").manual_seed(splits)
    N = (8 + 2 * 4) * 128
    partials = torch.randn(splits, B, N, device="cuda", generator=g) * 3
    hidden = torch.randn(B, 1, 512, device="cuda", generator=g).to(torch.bfloat16)
    cos, sin = model.model.rotary_emb(hidden, torch.randint(0, 4000, (B, 1), device="cuda", generator=g))
    block, offset = torch.randperm(B, device="cuda", generator=g), torch.randint(0, 16, (B,), device="cuda",
                                                                                generator=g)
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    runs = []
    for qkv, kw in ((partials, dict(dtype=torch.bfloat16)), (total.to(torch.bfloat16), {})):
        pools = [torch.zeros(B, 4, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        runs.append(list(rope_write(qkv, cos, sin, *_qk_norms(layer), *_heads(layer), G, *pools, block, offset, **kw))
                    + pools)
    for name, a, b in zip(("q_own", "q_pre", "k", "v", "k pool", "v pool"), *runs):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), (name, (a.float() - b.float()).abs().max())


def test_cuda_silu_gate_matches_float64_and_the_modules_bf16():
    """The SiLU gate kernel at the 1,024-row step's shape (Qwen3-0.6B's 3,072 intermediate columns) in bf16 against
    float64 (2 units of bf16's last place of the largest value: its two roundings) and against torch's eager
    ``F.silu(gate) * up`` in bf16 (the modules' math: the same roundings, up to the float32 exponential's and
    division's last bits: equal but for at most one element in a thousand)."""
    from treerl.rollout.silu_gate import silu_gate

    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(1024, 6144, device="cuda", generator=g) * 3).bfloat16()
    got = silu_gate(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    eps = torch.finfo(torch.bfloat16).eps
    assert (got.double() - want).abs().max() <= 2 * eps * want.abs().max()
    gate, up = gate_up.chunk(2, dim=-1)
    eager = torch.nn.functional.silu(gate) * up
    assert (got.double() - eager.double()).abs().max() <= eps * eager.double().abs().max()
    assert int((got != eager).sum()) <= got.numel() // 1000  # (without silu's bf16 rounding: ~a quarter differ)


@pytest.mark.parametrize("compile_decode", [False, True], ids=["graphs", "compiled+graphs"])
def test_cuda_small_products_in_the_engine(compile_decode, monkeypatch):
    """A float32 rollout through the kernel step at few rows takes the small-row products (every
    decode step's layers: the spy counts them; on sm_90+ from 64 rows as a chain of dependent launches) and gives the greedy tokens of the eager engine (16
    rows) and logprobs equal to a float64 full forward (96 rows: two row tiles); above ``MAX_ROWS``
    rows the step keeps cuBLAS, with the SiLU gate kernel between the tail's halves (the same greedy tokens)."""
    import treerl.rollout.blocks as blocks
    import treerl.rollout.layer_math as layer_math
    from treerl.rollout import small_products

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(dtype=torch.float32, seed=2, head_dim=128, num_attention_heads=4, num_key_value_heads=2).cuda()
    prompts = random_prompts([9, 30, 3, 17], seed=6)
    greedy = SamplingParams(n=4, temperature=0.0, max_new_tokens=24, seed=3)
    sampled = SamplingParams(n=24, temperature=0.8, max_new_tokens=16, seed=3)  # (96 rows: two row tiles of 64)
    calls = []
    gated = small_products.gated
    monkeypatch.setattr(small_products, "gated", lambda *a, **k: calls.append(a[0].shape[0]) or gated(*a, **k))
    engine = RolloutEngine(copy.deepcopy(model), compile_decode=compile_decode)
    groups = engine.generate(prompts, greedy)
    assert engine.decode_blocks.small and calls and max(calls) <= small_products.MAX_ROWS, calls
    eager = RolloutEngine(copy.deepcopy(model), cuda_graphs=False).generate(prompts, greedy)
    for ga, gb in zip(groups, eager):
        for a, b in zip(ga, gb):
            assert a.completion_ids.tolist() == b.completion_ids.tolist()
    calls.clear()
    assert_float64_logprobs(model, zip(prompts, engine.generate(prompts, sampled)), 0.8)
    assert max(calls) > 64, calls
    assert engine.decode_blocks.chain == small_products.chains_here("cuda")  # (sm_90+, 64+ rows: dependent launches)
    assert engine.decode_blocks.qkv_link == small_products.chains_here("cuda")  # (the Q/K/V product joins the chain)
    calls.clear()
    monkeypatch.setattr(small_products, "MAX_ROWS", 0)
    gates = []  # (above MAX_ROWS: the tail's SiLU gate through silu_gate, between the compiled halves)
    silu_gate = layer_math.silu_gate
    monkeypatch.setattr(layer_math, "silu_gate", lambda gu: gates.append(gu.shape[0]) or silu_gate(gu))
    large = RolloutEngine(copy.deepcopy(model), compile_decode=compile_decode)
    for ga, gb in zip(large.generate(prompts, greedy), eager):
        for a, b in zip(ga, gb):
            assert a.completion_ids.tolist() == b.completion_ids.tolist()
    assert not calls and len(gates) > len(model.model.layers) and large.decode_blocks.gated  # (steps, not the probe)
