"""Tree rollouts on the continuous-batching path (CPU, float64, tiny random Qwen3): greedy
forks equal a per-prompt full forward under several fork schedules (rows stopping before
a fork, stop strings, admissions into freed slots, compaction); sampled trees' behaviour
logprobs and shared prefixes; a fork's K/V stored once; weight updates recomputing fork
segments; prefix-cache hits; a budget of one tree at a time; multi-level attention."""

import copy
from itertools import product

import pytest
import torch

from helpers.models import tiny_model
from helpers.reference import completion_logprobs
from helpers.rollout import VOCAB, greedy_reference as _greedy_reference, random_prompts, sampling, target_length
from treerl.rollout import PromptQueue, RolloutEngine, SamplingParams, ForkLayout

MAX_NEW = 20


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def params(**kw):
    return sampling(MAX_NEW, **kw)


def greedy_reference(model, prompt, max_new=MAX_NEW):
    return _greedy_reference(model, prompt, max_new)


def check_greedy_trees(model, groups, prompts, p: SamplingParams, refs=None):
    """Every leaf equals the prompt's greedy reference; the leaves are exactly the branches
    of the forks the reference passed (a row that stopped at or before a fork is not forked)."""
    schedule = p.branch_schedule()
    assert sorted(g.prompt_index for g in groups) == list(range(len(prompts)))
    for g in groups:
        prompt = prompts[g.prompt_index]
        ref = greedy_reference(model, prompt) if refs is None else refs[g.prompt_index]
        passed = [f for t, f in schedule.items() if len(ref) > t]
        assert [c.branch for c in g] == list(product(range(p.n), *(range(f) for f in passed))), g.prompt_index
        lp = completion_logprobs(model, prompt, ref)
        for c in g:
            assert c.prompt_ids.tolist() == prompt
            assert c.completion_ids.tolist() == ref, (g.prompt_index, c.branch)
            assert c.finish_reason == ("stop" if target_length(ref) <= MAX_NEW else "length")
            assert torch.allclose(c.logprobs, lp, rtol=1e-9, atol=1e-12), (c.logprobs - lp).abs().max()
    return sum(len(g) for g in groups)


SCHEDULES = {
    "one-point": dict(branch_points=[5], branch_factor=3),
    "points-factors": dict(n=1, branch_points=[2, 7, 11], branch_factor=[2, 1, 3]),
    "every": dict(branch_every=6, branch_factor=2),
    "fork-at-1": dict(branch_points=[1], branch_factor=2),
}


@pytest.mark.parametrize("schedule", SCHEDULES, ids=list(SCHEDULES))
@pytest.mark.parametrize("static_kv", [False, True], ids=["sliced-kv", "static-kv"])
def test_greedy_forks_equal_per_prompt_full_forward(model, schedule, static_kv):
    prompts = random_prompts([7, 1, 13, 4, 10, 3, 9], seed=1)
    p = params(**SCHEDULES[schedule])
    G = p.max_leaves
    engine = RolloutEngine(model, static_kv=static_kv, sync_every=3, prefill_chunk_tokens=16)
    groups = list(engine.generate_stream(prompts, p, max_rows=2 * G))  # 2 groups at a time
    lengths, points = {len(g[0]) for g in groups}, p.branch_schedule()
    assert max(lengths) > min(points)  # forks happen
    if schedule != "fork-at-1":  # (completions have >= 2 tokens)
        assert any(n <= t for n in lengths for t in points), "some rows should stop before a fork"
    leaves = check_greedy_trees(model, groups, prompts, p)
    s = engine.stats
    assert s.admissions > 2 and s.forks > 0
    assert s.generated_tokens == sum(len(c) for g in groups for c in g) and leaves > len(prompts)


def test_generate_returns_trees_in_prompt_order(model):
    prompts = random_prompts([6, 11, 4], seed=2)
    p = params(branch_points=[3, 8], branch_factor=[2, 2])
    groups = RolloutEngine(model, sync_every=2).generate(prompts, p)
    assert [g.prompt_index for g in groups] == [0, 1, 2]
    check_greedy_trees(model, groups, prompts, p)


def test_sampled_trees_logprobs_shared_prefixes_and_early_stops(model):
    """Temperature/top-k sampling with stop tokens, a sync window longer than the gaps
    between forks: behaviour logprobs equal a full forward; siblings share exactly the
    tokens before their fork; rows that stopped at or before a fork were not forked; every
    fork gave all its children."""
    stops = list(range(0, VOCAB, 17))
    p = SamplingParams(n=3, temperature=1.2, top_k=50, max_new_tokens=14, seed=5, branch_points=[3, 5, 9],
                       branch_factor=[2, 3, 2], stop_token_ids=stops)
    prompts = random_prompts([9, 3, 14, 6], seed=3)
    engine = RolloutEngine(model, sync_every=5)
    groups = list(engine.generate_stream(prompts, p, max_rows=2 * p.max_leaves))
    points = [3, 5, 9]
    stopped_early = 0
    for g in groups:
        prompt = prompts[g.prompt_index]
        branches = {c.branch for c in g}
        assert len(branches) == len(g)
        for c in g:
            ids = c.completion_ids.tolist()
            assert torch.allclose(c.logprobs, completion_logprobs(model, prompt, ids, 1.2), rtol=1e-9, atol=1e-12)
            depth = sum(len(ids) > t for t in points)
            assert len(c.branch) == 1 + depth
            stopped_early += depth < 3
            if c.finish_reason == "stop":
                assert ids[-1] in stops and not set(ids[:-1]) & set(stops)
            else:
                assert len(ids) == 14
            for k in range(1, depth + 1):  # all siblings of each fork passed are there
                f = [2, 3, 2][k - 1]
                assert all(any(d.branch[: k + 1] == c.branch[:k] + (j,) for d in g) for j in range(f))
        for c, d in product(g, g):
            if c.branch == d.branch:
                continue
            k = next(i for i, (a, b) in enumerate(zip(c.branch, d.branch)) if a != b)
            shared = 0 if k == 0 else points[k - 1]
            assert c.completion_ids[:shared].tolist() == d.completion_ids[:shared].tolist()
    assert stopped_early > 0
    again = list(RolloutEngine(model, sync_every=5).generate_stream(prompts, p, max_rows=2 * p.max_leaves))
    key = lambda gs: sorted((g.prompt_index, [(c.branch, c.completion_ids.tolist()) for c in g]) for g in gs)  # noqa: E731
    assert key(again) == key(groups)  # same seed, same trees


def test_fork_segment_stored_once_holds_the_parents_kv(model):
    """n=2, one fork into 4 at token 8: the cache holds each prompt once, each parent's 8
    tokens once (in its fork segment: the K/V a full forward computes there), and each leaf
    only its own tokens; kv_slots counts exactly that."""
    prompt = random_prompts([20], seed=4)[0]
    p = params(n=2, branch_points=[8], branch_factor=4, stop_strings=[], max_new_tokens=16)
    engine = RolloutEngine(model, sync_every=4, keep_stream_buffers=True)
    [group] = engine.generate_stream([prompt], p)
    assert len(group) == 8 and {len(c) for c in group} == {16}
    tree = ForkLayout.of(p)
    assert tree.tokens_per_group(32) == 32 + 2 * 16 + 8 * 16  # prompt 32, 2 segments of 16, 8 rows x 16 own
    assert engine.stats.kv_slots == tree.tokens_per_group(32) < p.max_leaves * (32 + 16)
    cache = engine._stream_arena[1]["cache"]
    layer = cache.layers[0]
    # own tokens paged: 8 blocks of 16 slots (one per leaf; + the trash block)
    assert layer.pk.shape[0] == 1 and layer.fk[0].shape[0] == 2 and layer.ok.shape[0] == 8 + 1
    assert layer.fk[0].shape[2] == 16 and layer.ok.shape[2] == 16
    ids = prompt + group[0].completion_ids.tolist()
    with torch.no_grad():
        full = model(torch.tensor([ids]), use_cache=True).past_key_values
    keys = full.layers[0].keys[0] if hasattr(full, "layers") else full[0][0][0]  # [Hkv, len, D]
    P = len(prompt)
    assert torch.allclose(layer.pk[0, :, :P], keys[:, :P], rtol=1e-9, atol=1e-12)
    assert torch.allclose(layer.fk[0][0, :, :8], keys[:, P : P + 8], rtol=1e-9, atol=1e-12)  # sample 0's segment
    own = keys[:, P + 8 : P + 15]  # leaf 0's own tokens (greedy: every leaf's), each leaf in a block of its own
    assert all(torch.allclose(layer.ok[b, :, :7], own, rtol=1e-9, atol=1e-12) for b in range(8))


def test_weight_update_recomputes_fork_segments():
    """Weights updated while the stream is paused at its first finished tree (same thread,
    no timing): trees past their forks recompute prompt, fork segments and own tokens; every
    logprob equals a full forward of the weights that produced it, on the same prefix."""
    a, b = tiny_model(seed=0), tiny_model(seed=7)
    prompts = random_prompts([9, 4, 17, 6], seed=15)
    p = params(n=2, branch_points=[2, 4], branch_factor=2)
    engine = RolloutEngine(copy.deepcopy(a), version=0, sync_every=1)
    stream = engine.generate_stream(prompts, p, max_rows=4 * p.max_leaves)
    groups = [next(stream)]
    engine.update_weights(b)
    groups += list(stream)
    assert engine.stats.recomputes >= 1
    after_fork = 0
    for g in groups:
        prompt = prompts[g.prompt_index]
        for c in g:
            ids = c.completion_ids.tolist()
            k = int((c.versions == 0).sum())
            assert c.versions.tolist() == [0] * k + [1] * (len(ids) - k)
            after_fork += 4 < k < len(ids)
            assert torch.allclose(c.logprobs[:k], completion_logprobs(a, prompt, ids[:k]), rtol=1e-9, atol=1e-12)
            assert torch.allclose(c.logprobs[k:], completion_logprobs(b, prompt + ids[:k], ids[k:]),
                                  rtol=1e-9, atol=1e-12)
    assert after_fork >= 2, "no tree was past its forks at the update"


def test_prefix_cache_hit_with_tree_rollouts(model):
    """Turn 2 extends turn 1's prompt and completion and forks: it prefills only its new
    tokens and turn 1's last token (turn 1's row of one kept its context), and its trees
    equal a full forward."""
    engine = RolloutEngine(model, sync_every=2, prefix_cache_tokens=1000)
    p1 = random_prompts([13], seed=19)[0]
    [g1] = engine.generate_stream([p1], params(n=1))
    p2 = p1 + g1[0].completion_ids.tolist() + [5, 6, 7]
    p = params(n=2, branch_points=[3], branch_factor=2)
    [g2] = engine.generate_stream([p2], p)
    kept = 13 + len(g1[0].completion_ids) - 1
    assert engine.stats.prefix_cache_hit_tokens == kept and engine.stats.prefill_tokens == len(p2) - kept == 4
    check_greedy_trees(model, [g2], [p2], p)


def test_budget_of_one_tree_runs_groups_one_at_a_time(model):
    """A budget below one tree's slots: one group slot, trees run one after another (and a
    longer prompt arriving later rebuilds the batch); every tree comes out once, equal to
    a per-prompt full forward."""
    p = params(n=2, branch_points=[4], branch_factor=2)
    short = random_prompts([3, 5, 4], seed=13)
    queue = PromptQueue()
    for prompt in short:
        queue.put(prompt)
    engine = RolloutEngine(model, sync_every=2, max_batch_tokens=100)
    stream = engine.generate_stream(queue, p)
    first = next(stream)
    long = random_prompts([40], seed=14)[0]
    queue.put(long)
    queue.close()
    groups = [first] + list(stream)
    check_greedy_trees(model, groups, short + [long], p)
    tree = ForkLayout.of(p)
    assert engine.stats.reallocations == 1
    assert engine.stats.kv_slots == tree.tokens_per_group(48) > 100  # one group, over the budget alone
    assert engine.stats.decode_rows <= engine.stats.decode_steps * tree.rows


def test_tree_layout():
    tree = ForkLayout(n=2, points=(3, 7), factors=(3, 2), max_new=12)
    assert tree.rows == 12 and [tree.nodes(k) for k in range(3)] == [2, 6, 12]
    assert [tree.rows_per_node(k) for k in range(3)] == [6, 2, 1]
    assert tree.first_rows() == [0, 6]
    assert tree.children(6, 1) == [8, 10] and tree.children(8, 2) == [9]
    assert [tree.branch(p, 2) for p in (0, 9, 11)] == [(0, 0, 0), (1, 1, 1), (1, 2, 1)]
    assert tree.branch(8, 1) == (1, 1) and tree.branch(6, 0) == (1,)
    assert [tree.depth_of(n) for n in (3, 4, 7, 8)] == [0, 1, 1, 2]
    assert tree.own_start == 7 and tree.own_capacity == 16
    assert tree.tokens_per_group(16) == 16 + 2 * 16 + 6 * 16 + 12 * 16
    assert ForkLayout.of(SamplingParams(n=3, max_new_tokens=10, branch_every=4, branch_factor=2)).points == (4, 8)
    plain = ForkLayout.of(SamplingParams(n=4, max_new_tokens=10))
    assert plain.rows == 4 and plain.depth == 0 and plain.tokens_per_group(16) == 16 + 4 * 16


def test_fork_attention_equals_attention_over_the_whole_sequence():
    """Prompt (per group of G rows) + a fork level (per node of r rows) + own tokens, merged
    by LSE == softmax over all the row's visible keys, with GQA and masked slots."""
    from treerl.rollout.shared import fork_attention

    g = torch.Generator().manual_seed(0)
    NG, G, r, Hkv, gq, D, P, F, L = 2, 6, 2, 2, 3, 8, 9, 5, 7
    B, Hq, nodes = NG * G, Hkv * gq, NG * G // r
    dt = torch.float64

    def rnd(*s):
        return torch.randn(*s, generator=g, dtype=dt)

    q = rnd(B, Hq, 1, D)
    pk, pv, fk, fv, ok, ov = rnd(NG, Hkv, P, D), rnd(NG, Hkv, P, D), rnd(nodes, Hkv, F, D), rnd(nodes, Hkv, F, D), \
        rnd(B, Hkv, L, D), rnd(B, Hkv, L, D)
    plen, flen, olen = torch.tensor([9, 4]), torch.randint(0, F + 1, (nodes,), generator=g), \
        torch.randint(0, L + 1, (B,), generator=g)
    zero, neg = torch.zeros((), dtype=dt), torch.tensor(torch.finfo(dt).min, dtype=dt)

    def mask(n, cap):
        return torch.where(torch.arange(cap)[None] < n[:, None], zero, neg)[:, None, None]

    out = fork_attention(q, ok, ov, mask(olen, L), pk, pv, mask(plen, P), [(fk, fv, mask(flen, F), r)], 0.3, G)
    assert out.shape == (B, 1, Hq, D)
    for i in range(B):
        grp, node = i // G, i // r
        k = torch.cat([pk[grp, :, : plen[grp]], fk[node, :, : flen[node]], ok[i, :, : olen[i]]], dim=1)
        v = torch.cat([pv[grp, :, : plen[grp]], fv[node, :, : flen[node]], ov[i, :, : olen[i]]], dim=1)
        k, v = k.repeat_interleave(gq, 0), v.repeat_interleave(gq, 0)
        ref = torch.softmax(q[i] @ k.transpose(-1, -2) * 0.3, dim=-1) @ v
        assert torch.allclose(out[i, 0], ref[:, 0], rtol=1e-12, atol=1e-13)
