"""Continuous batching (RolloutEngine.generate_stream) on tiny random Qwen3 models (CPU):
greedy streams equal per-prompt greedy decoding by plain full forwards, token by token and
logprob by logprob; freed slots take new prompts (fewer decode steps than waves); groups
come out as they finish; versions and KV after a mid-stream weight update; prompts added
from another thread are each generated exactly once; fixed-shape (CUDA-graph) steps,
compaction and capacity growth."""

import copy
import random
import threading
import time

import pytest
import torch

from helpers.models import after_each_forward, tiny_model
from helpers.reference import completion_logprobs
from helpers.rollout import VOCAB, greedy_reference as _greedy_reference, random_prompts, sampling, target_length
from treerl.rollout import PromptQueue, RolloutEngine, RolloutStats, SamplingParams, log_reads

MAX_NEW = 24
# the fixed-shape variants (static K/V, as on CUDA) prefill small admissions in fixed buckets too
# (treerl.rollout.prefill_graphs, eagerly on the CPU), as CUDA's default does
GRAPH_TOKENS = {False: 0, True: 512}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def params(**kw):
    return sampling(MAX_NEW, **kw)


def greedy_reference(model, prompt, max_new=MAX_NEW):
    return _greedy_reference(model, prompt, max_new)


def check_greedy(model, groups, prompts, n, rtol=1e-9, atol=1e-12):
    assert sorted(g.prompt_index for g in groups) == list(range(len(prompts)))
    for g in groups:
        p = prompts[g.prompt_index]
        ref = greedy_reference(model, p)
        assert g.prompt_ids.tolist() == p
        assert [c.branch for c in g] == [(j,) for j in range(n)]
        for c in g:
            assert c.completion_ids.tolist() == ref, g.prompt_index
            assert c.finish_reason == ("stop" if len(ref) < MAX_NEW or target_length(ref) <= MAX_NEW else "length")
            lp = completion_logprobs(model, p, ref)
            assert torch.allclose(c.logprobs.double(), lp, rtol=rtol, atol=atol), (c.logprobs - lp).abs().max()


@pytest.mark.parametrize("static_kv", [False, True], ids=["sliced-kv", "static-kv"])
@pytest.mark.parametrize("sync_every", [1, 3])
def test_stream_greedy_equals_per_prompt_reference(model, static_kv, sync_every):
    prompts = random_prompts([7, 1, 13, 4, 10, 3, 9, 5, 12, 2], seed=1)
    engine = RolloutEngine(model, static_kv=static_kv, sync_every=sync_every, prefill_chunk_tokens=16,
                           prefill_graph_tokens=GRAPH_TOKENS[static_kv])
    groups = list(engine.generate_stream(prompts, params(), max_rows=4))  # 2 groups at a time
    lengths = {g.prompt_index: len(g[0]) for g in groups}
    assert len(set(lengths.values())) > 3, "the length rule should give varied lengths"
    check_greedy(model, groups, prompts, 2)
    assert engine.stats.admissions > 2  # admissions into freed slots
    assert engine.stats.generated_tokens == 2 * sum(lengths.values())


def test_float32_stream_matches_reference():
    model = tiny_model(dtype=torch.float32, seed=3)
    prompts = random_prompts([5, 17, 2, 8, 11, 6], seed=4)
    groups = list(RolloutEngine(model, sync_every=2).generate_stream(prompts, params(n=1), max_rows=3))
    check_greedy(model, groups, prompts, 1, rtol=1e-5, atol=1e-5)


def test_freed_slots_take_new_prompts_fewer_steps_than_waves(model):
    prompts = random_prompts([6] * 12, seed=2)
    G, rows = 2, 6  # 3 groups at a time
    engine = RolloutEngine(model, sync_every=1)
    groups = list(engine.generate_stream(prompts, params(n=G), max_rows=rows))
    check_greedy(model, groups, prompts, G)
    lengths = [max(len(c) for c in g) for g in sorted(groups, key=lambda g: g.prompt_index)]
    # waves of 3 groups, in order: each wave decodes until its longest row is done and its last read finished
    waves = sum(max(lengths[i : i + 3]) - 1 + log_reads.READ_LAG - 1 for i in range(0, 12, 3))
    assert engine.stats.decode_steps < waves, (engine.stats.decode_steps, waves, lengths)


def test_groups_come_out_as_they_finish(model):
    prompts = random_prompts([5, 8, 3, 9, 4, 7, 6, 2], seed=6)
    length = [len(greedy_reference(model, p)) for p in prompts]
    engine = RolloutEngine(model, sync_every=1)
    seen = []
    for g in engine.generate_stream(prompts, params(n=2), max_rows=4):
        seen.append((engine.stats.decode_steps, g.prompt_index))
    # expected: two groups run at a time; a group admitted after decode step a (its first
    # token from the prefill) samples its last token at step a + length - 1; the read of that
    # token is finished once READ_LAG more steps are queued, so the group is yielded after step
    # a + length - 1 + READ_LAG, and the next waiting prompt takes its slots then
    lag = log_reads.READ_LAG
    expected, running, waiting = [], {0: length[0] - 1, 1: length[1] - 1}, list(range(2, len(prompts)))
    while running:
        step = min(running.values())
        done = sorted(k for k, s in running.items() if s == step)
        for k in done:
            expected.append((step + lag, k))
            del running[k]
        for _ in done:
            if waiting:
                k = waiting.pop(0)
                running[k] = step + lag + length[k] - 1
    assert len(set(length)) > 3
    assert sorted(seen) == sorted(expected)
    assert [s for s, _ in seen] == sorted(s for s, _ in seen)  # yielded as they finished
    assert seen[-1][0] == engine.stats.decode_steps


@pytest.mark.parametrize("static_kv", [False, True], ids=["sliced-kv", "static-kv"])
def test_versions_and_kv_after_mid_stream_weight_update(static_kv):
    a, b = tiny_model(seed=0), tiny_model(seed=1)
    prompts = random_prompts([5, 9, 3, 7, 6, 4, 8], seed=3)
    engine = RolloutEngine(copy.deepcopy(a), version=0, sync_every=4, static_kv=static_kv,
                           prefill_graph_tokens=GRAPH_TOKENS[static_kv])
    decode_calls = []
    updater = threading.Thread(target=lambda: engine.update_weights(b, version=1))

    def hook(query_length):  # at the end of every forward
        if query_length == 1:
            decode_calls.append(1)
            if len(decode_calls) == 6:  # another thread pushes weights during decode step 6
                updater.start()
                deadline = time.monotonic() + 120  # a condition, not a sleep: ends once the update is pending
                while not engine._pending_updates and time.monotonic() < deadline:
                    time.sleep(1e-4)

    handle = after_each_forward(engine.model, hook)
    try:
        groups = list(engine.generate_stream(prompts, params(n=2, max_new_tokens=MAX_NEW), max_rows=4))
    finally:
        handle.remove()
        updater.join()
    assert engine.stats.recomputes >= 1 and engine.version == 1
    assert (engine.stats.prefill_graph_calls > 0) == static_kv
    both = 0
    for g in groups:
        p = prompts[g.prompt_index]
        for c in g:
            ids, versions = c.completion_ids.tolist(), c.versions.tolist()
            cut = versions.count(0)
            assert versions == [0] * cut + [1] * (len(ids) - cut)
            both += 0 < cut < len(ids)
            lp_a, lp_b = completion_logprobs(a, p, ids), completion_logprobs(b, p, ids)
            for t, v in enumerate(versions):
                m = a if v == 0 else b
                with torch.no_grad():
                    assert int(m(torch.tensor([p + ids[:t]])).logits[0, -1].argmax()) == ids[t]
                ref = lp_a[t] if v == 0 else lp_b[t]
                assert torch.allclose(c.logprobs[t], ref, rtol=1e-9, atol=1e-12)
            assert len(ids) == min(target_length(ids), MAX_NEW)
    assert both, "no completion outlived the update"
    assert any(min(g[0].versions.tolist()) == 1 for g in groups)  # admitted after the update


def test_prompts_from_another_thread_none_lost_or_duplicated(model):
    prompts = random_prompts([random.Random(7).randint(1, 12) for _ in range(14)], seed=7)
    queue = PromptQueue()
    engine = RolloutEngine(model, sync_every=2)
    keys = [100 + i for i in range(len(prompts))]

    def producer():
        rng = random.Random(0)
        for k, p in zip(keys, prompts):
            time.sleep(rng.random() * 0.02)
            assert queue.put(p, key=k)
        queue.close()

    thread = threading.Thread(target=producer)
    thread.start()
    try:
        groups = list(engine.generate_stream(queue, params(n=3), max_rows=9))
    finally:
        thread.join()
    assert sorted(g.prompt_index for g in groups) == keys
    for g in groups:
        p = prompts[keys.index(g.prompt_index)]
        ref = greedy_reference(model, p)
        assert len(g) == 3 and [c.branch for c in g] == [(0,), (1,), (2,)]
        assert all(c.prompt_ids.tolist() == p and c.completion_ids.tolist() == ref for c in g)
    assert not queue.put([1, 2])  # closed


def test_idle_timeout_ends_the_stream_atomically(model):
    queue = PromptQueue(idle_timeout=0)
    assert queue.put([1, 2, 3])
    groups = list(RolloutEngine(model).generate_stream(queue, params(n=1)))
    assert [g.prompt_index for g in groups] == [0]
    assert not queue.put([4, 5])  # refused: that stream has ended, a new one must take it
    # a waiting stream takes prompts put later, then ends once idle for idle_timeout
    queue = PromptQueue(idle_timeout=0.5)
    assert queue.put([1, 2, 3], key="a")
    out = []
    stream = RolloutEngine(model).generate_stream(queue, params(n=1))
    out.append(next(stream).prompt_index)
    assert queue.put([6, 7], key="b")
    out += [g.prompt_index for g in stream]
    assert out == ["a", "b"]


def test_sampled_stream_logprobs_and_compaction(model):
    """Temperature/top-k/top-p sampling with stop tokens: behaviour logprobs equal a full
    forward; rows of a long tail are compacted into smaller decode steps."""
    prompts = random_prompts([9, 3, 14, 6, 2, 11, 5, 8], seed=5)
    p = SamplingParams(n=4, temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=30, seed=3,
                       stop_token_ids=list(range(0, VOCAB, 13)))
    engine = RolloutEngine(model, sync_every=2)
    groups = list(engine.generate_stream(prompts, p, max_rows=32))
    assert sorted(g.prompt_index for g in groups) == list(range(len(prompts)))
    lengths = []
    for g in groups:
        assert len(g) == 4
        for c in g:
            ids = c.completion_ids.tolist()
            lengths.append(len(ids))
            ref = completion_logprobs(model, prompts[g.prompt_index], ids, 0.8)
            assert torch.allclose(c.logprobs, ref, rtol=1e-9, atol=1e-12)
            if c.finish_reason == "stop":
                assert ids[-1] % 13 == 0 and all(t % 13 for t in ids[:-1])
            else:
                assert len(ids) == 30 and all(t % 13 for t in ids)
    assert len(set(lengths)) > 3
    s = engine.stats
    assert s.decode_rows < s.decode_steps * 32, "the tail should decode fewer rows than the batch has"
    assert s.live_rows <= s.decode_rows
    # same seed, same stream
    again = list(RolloutEngine(model, sync_every=2).generate_stream(prompts, p, max_rows=32))
    key = lambda gs: sorted((g.prompt_index, [c.completion_ids.tolist() for c in g]) for g in gs)  # noqa: E731
    assert key(again) == key(groups)


def test_capacity_grows_for_a_longer_prompt(model):
    queue = PromptQueue()
    short, long = random_prompts([3, 40], seed=9)
    queue.put(short)
    engine = RolloutEngine(model, sync_every=1)
    stream = engine.generate_stream(queue, params(n=2), max_rows=4)
    first = next(stream)
    queue.put(long)
    queue.close()
    rest = list(stream)
    check_greedy(model, [first] + rest, [short, long], 2)


@pytest.mark.parametrize("budget,max_new,grows,reallocations",
                         [(1 << 17, 24, 2, 0), (192, 24, 1, 1), (1200, 200, 2, 1)])
def test_prompt_store_grows_geometrically(model, budget, max_new, grows, reallocations):
    """A conversation's prompts growing by 16 tokens a turn (17 ... 113), one at a time in one
    stream of (at most) two group slots: the prompt store doubles (32 -> 64 -> 128: 2
    growths, not 5). With a budget of two groups of 32 prompt slots (192 K/V slots: 2 x (32
    + 2 rows x 32 own slots)), the batch is rebuilt for one group of 64 prompt slots (not
    48), then grown in place to 128 (not 80, 96, 112, 128). With own stores of 4 blocks a
    row (200 new tokens) and a pool of all of them (1024 slots), growth in place stops where
    the budget does (64, then 80, not 128), and the rebuild doubles (160). Never over budget."""
    prompts = random_prompts([17, 33, 49, 65, 81, 97, 113], seed=34)
    queue = PromptQueue()
    engine = RolloutEngine(model, sync_every=2, max_batch_tokens=budget)
    stream = engine.generate_stream(queue, sampling(max_new, n=2), max_rows=4)
    groups = []
    for p in prompts:
        queue.put(p)
        groups.append(next(stream))
    queue.close()
    assert list(stream) == []
    check_greedy(model, groups, prompts, 2)
    assert (engine.stats.prefix_grows, engine.stats.reallocations) == (grows, reallocations)
    assert engine.stats.kv_slots <= budget


@pytest.mark.parametrize("static_kv", [False, True], ids=["sliced-kv", "static-kv"])
def test_groups_of_one_row_keep_their_prompts_in_own_blocks(static_kv):
    """Groups of one row (a serving batch: ``n = 1``) keep their prompts in their rows' own
    blocks, not in a prompt store sized for the longest prompt: prompts of 5 ... 113 tokens
    never grow or rebuild a prompt store, admission is by the blocks a prompt takes, and a
    pool too small for four such rows at a time preempts rows (prompt and tokens so far
    recomputed into new blocks). Every greedy completion and its logprobs equal a forward of
    the sequence alone, in float64."""
    model = tiny_model(max_position_embeddings=144)  # own capacity per row: 144 slots, 9 blocks of 16
    prompts = random_prompts([5, 17, 33, 49, 65, 81, 97, 113, 90, 40, 7, 100], seed=34)
    budget = 288  # 4 group slots (of 16 prompt slots, unused) and a pool of 14 blocks
    engine = RolloutEngine(model, sync_every=1, max_batch_tokens=budget, static_kv=static_kv, kv_block_size=16,
                           prefill_graph_tokens=GRAPH_TOKENS[static_kv])
    queue = PromptQueue([prompts[0]])  # (the group slots are sized for the prompts waiting at the start)
    stream = engine.generate_stream(queue, params(n=1), max_rows=4)
    groups = [next(stream)]
    queue.put_many([(i, p) for i, p in enumerate(prompts) if i])
    queue.close()
    groups += list(stream)
    check_greedy(model, groups, prompts, 1)
    s = engine.stats
    assert (s.prefix_grows, s.reallocations) == (0, 0) and s.preemptions > 0, s
    assert (s.prefill_graph_calls > 0) == static_kv, s
    assert s.kv_slots <= budget


def prefill_sizes(engine) -> list[list[int]]:
    """A list that gets each of ``engine``'s prefill calls' sequence lengths (sorted), as they run."""
    sizes, prefill = [], engine.prefiller

    def recording(seqs, cached=None, stats=None):
        sizes.append(sorted(len(x) for x in seqs))
        return prefill(seqs, cached, stats)

    engine.prefiller = recording
    return sizes


def test_admissions_while_rows_decode_prefill_at_most_a_chunk(model):
    """While rows decode, one admission prefills at most ``prefill_chunk_tokens`` new tokens:
    four 12-token prompts and a 3-token one arrive together behind a running group
    (chunk: 20 tokens) and are admitted one 12-token prompt per admission, the short prompt
    with the first (it fits what is left, so it passes the longer ones); with nothing
    decoding, a burst likewise (a short request waits for one piece, not for all). Greedy
    outputs equal the reference."""
    prompts = random_prompts([5, 12, 12, 12, 12, 3], seed=36)
    engine = RolloutEngine(model, sync_every=1, prefill_chunk_tokens=20)
    sizes = prefill_sizes(engine)
    queue = PromptQueue()
    arrived = threading.Event()

    def first_tokens(delta):  # (the stream's thread, at a sync: the others arrive while group 0 decodes)
        if not arrived.is_set():
            arrived.set()
            queue.put_many([(i, p) for i, p in enumerate(prompts) if i])
            queue.close()

    long = SamplingParams(n=1, temperature=0, max_new_tokens=MAX_NEW)  # no stop: decodes MAX_NEW steps
    queue.put(prompts[0], 0, params=long, listener=first_tokens)
    groups = {g.prompt_index: g for g in engine.generate_stream(queue, params(n=1), max_rows=8)}
    assert sizes == [[5], [3, 12], [12], [12], [12]]
    no_stop = _greedy_reference(model, prompts[0], MAX_NEW, length=lambda ids: MAX_NEW + 1)
    assert groups[0][0].completion_ids.tolist() == no_stop and len(no_stop) == MAX_NEW
    for i in range(1, 6):
        assert groups[i][0].completion_ids.tolist() == greedy_reference(model, prompts[i]), i
    assert engine.stats.admissions == 5
    # nothing decoding: a burst is admitted a chunk per decode step too, the short prompt with the first
    sizes.clear()
    burst = {g.prompt_index: g for g in engine.generate_stream(prompts[1:], params(n=1), max_rows=8)}
    assert sizes == [[3, 12], [12], [12], [12]] and engine.stats.admissions == 4
    for i in range(5):
        assert burst[i][0].completion_ids.tolist() == greedy_reference(model, prompts[i + 1]), i


def test_a_short_prompt_passes_a_deferred_burst(model):
    """A short prompt that arrives while a burst is being admitted chunk by chunk is taken
    with the next chunk (it fits what the chunk leaves), not after every deferred prompt."""
    prompts = random_prompts([12, 12, 12, 12, 12, 3], seed=37)
    lag = log_reads.READ_LAG
    engine = RolloutEngine(model, sync_every=1, prefill_chunk_tokens=20)
    sizes = prefill_sizes(engine)
    queue = PromptQueue()
    sent = threading.Event()

    def first_tokens(delta):  # (the stream's thread, at the first sync: three 12-token prompts are deferred)
        if not sent.is_set():
            sent.set()
            queue.put(prompts[5], 5)
            queue.close()

    long = SamplingParams(n=1, temperature=0, max_new_tokens=MAX_NEW)
    queue.put(prompts[0], 0, params=long, listener=first_tokens)
    queue.put_many([(i, prompts[i]) for i in range(1, 5)])
    groups = {g.prompt_index: g for g in engine.generate_stream(queue, params(n=1), max_rows=8)}
    # (the first read, whose listener sends it, ends after step 1 + READ_LAG; a piece is admitted a step)
    assert sizes == [[12]] * (lag + 1) + [[3, 12]] + [[12]] * (5 - lag - 2)
    for i in range(1, 6):
        assert groups[i][0].completion_ids.tolist() == greedy_reference(model, prompts[i]), i


def test_admission_takes_the_fewest_new_tokens_after_the_oldest(model):
    """After the oldest waiting prompt, an admission takes the prompts with the fewest new
    tokens that fit the chunk: a 10-token prompt at the end of a burst of 12-token ones
    (chunk 24) starts with the first, where in arrival order it would wait for two pieces;
    the others keep their order. Greedy outputs equal the reference."""
    prompts = random_prompts([12, 12, 12, 10], seed=38)
    engine = RolloutEngine(model, sync_every=1, prefill_chunk_tokens=24)
    sizes = prefill_sizes(engine)
    groups = {g.prompt_index: g for g in engine.generate_stream(prompts, params(n=1), max_rows=8)}
    assert sizes == [[10, 12], [12, 12]] and engine.stats.admissions == 2
    for i, p in enumerate(prompts):
        assert groups[i][0].completion_ids.tolist() == greedy_reference(model, p), i


def test_stream_input_errors(model):
    engine = RolloutEngine(model)
    with pytest.raises(ValueError, match="branch point"):
        list(engine.generate_stream([[1, 2]], SamplingParams(branch_points=[4], max_new_tokens=4)))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        list(engine.generate_stream([[1], []], params()))
    queue = PromptQueue()
    queue.put([1, 2], key="x")
    queue.put([VOCAB], key="bad")
    queue.close()
    with pytest.raises(ValueError, match="prompt bad has token ids outside"):
        list(engine.generate_stream(queue, params()))
    assert model.config._attn_implementation == "sdpa"


# ------------------------------------------------------------------ shared prompt K/V
def test_two_level_attention_equals_attention_over_the_whole_sequence():
    """Prefix part (group queries folded together) + own part merged by LSE == softmax
    over prefix and own keys together, per row, with GQA and masked (stale) slots."""
    from treerl.rollout.shared import two_level_attention

    g = torch.Generator().manual_seed(0)
    NG, G, Hkv, gq, D, P, L = 3, 4, 2, 3, 8, 11, 7
    B, Hq = NG * G, Hkv * gq
    dt = torch.float64
    q = torch.randn(B, Hq, 1, D, generator=g, dtype=dt)
    pk, pv = torch.randn(NG, Hkv, P, D, generator=g, dtype=dt), torch.randn(NG, Hkv, P, D, generator=g, dtype=dt)
    ok, ov = torch.randn(B, Hkv, L, D, generator=g, dtype=dt), torch.randn(B, Hkv, L, D, generator=g, dtype=dt)
    plen = torch.tensor([11, 5, 1])
    olen = torch.randint(1, L + 1, (B,), generator=g)
    zero, neg = torch.zeros((), dtype=dt), torch.tensor(torch.finfo(dt).min, dtype=dt)
    pmask = torch.where(torch.arange(P)[None] < plen[:, None], zero, neg)[:, None, None]
    omask = torch.where(torch.arange(L)[None] < olen[:, None], zero, neg)[:, None, None]
    out = two_level_attention(q, ok, ov, omask, pk, pv, pmask, 0.3, G)
    assert out.shape == (B, 1, Hq, D)
    for r in range(B):
        grp = r // G
        k = torch.cat([pk[grp, :, : plen[grp]], ok[r, :, : olen[r]]], dim=1).repeat_interleave(gq, 0)
        v = torch.cat([pv[grp, :, : plen[grp]], ov[r, :, : olen[r]]], dim=1).repeat_interleave(gq, 0)
        ref = torch.softmax(q[r] @ k.transpose(-1, -2) * 0.3, dim=-1) @ v  # [Hq, 1, D]
        assert torch.allclose(out[r, 0], ref[:, 0], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("static_kv", [False, True], ids=["sliced-kv", "static-kv"])
def test_prompt_stored_once_and_prefilled_once_per_group(model, static_kv):
    """Groups of different prompt lengths (none a multiple of 16; two prompts share a
    prefix): each prompt is prefilled once for its G rows, the cache holds it once (rows
    hold only generated tokens), and greedy outputs equal a per-prompt full forward."""
    base = random_prompts([21], seed=11)[0]
    prompts = random_prompts([5, 33, 1, 18], seed=12) + [base, base[:13] + [7, 8, 9]]
    G = 3
    engine = RolloutEngine(model, static_kv=static_kv, sync_every=2, prefill_graph_tokens=GRAPH_TOKENS[static_kv])
    groups = list(engine.generate_stream(prompts, params(n=G), max_rows=3 * G))
    check_greedy(model, groups, prompts, G)
    s = engine.stats
    assert s.prefill_tokens == sum(len(p) for p in prompts)
    assert s.kv_slots == 3 * (48 + G * 32)  # 3 group slots x (prompt store 48 + 3 rows x 32 own slots)
    assert s.decode_rows <= s.decode_steps * 3 * G


def test_small_capacity_defers_longer_prompts_never_loses_a_sample(model):
    """A budget too small to grow the prompt store while groups run: the longer prompt
    (and the ones after it) wait until the batch drains, which is rebuilt with fewer,
    larger group slots; a prompt larger than the whole budget runs alone. Every group
    comes out once, equal to a per-prompt full forward."""
    G = 2  # own slots per group: 2 x 32; budget 200 -> 2 groups of 16-slot prompts
    short = random_prompts([3, 5, 4, 6], seed=13)
    later = random_prompts([40, 2, 150, 7], seed=14)
    queue = PromptQueue()
    for p in short:
        queue.put(p)
    engine = RolloutEngine(model, sync_every=2, max_batch_tokens=200)
    stream = engine.generate_stream(queue, params(n=G))
    first = next(stream)
    for p in later:
        queue.put(p)
    queue.close()
    groups = [first] + list(stream)
    check_greedy(model, groups, short + later, G)
    assert engine.stats.reallocations == 2
    assert engine.stats.kv_slots == 160 + G * 32  # the 150-token prompt alone: over the budget, never more


def test_weight_update_recomputes_shared_prompt_and_own_tokens(model):
    """Weights updated while the stream is paused at its first group (same thread, no
    timing): the running groups (different prompt lengths) recompute their prompt store
    and each row's own tokens; every logprob equals a full forward of the weights that
    produced it, on the same prefix."""
    b = tiny_model(seed=7)
    prompts = random_prompts([9, 4, 17, 6], seed=15)
    engine = RolloutEngine(copy.deepcopy(model), version=0, sync_every=1)
    stream = engine.generate_stream(prompts, params(n=2), max_rows=8)
    groups = [next(stream)]
    engine.update_weights(b)
    groups += list(stream)
    assert engine.stats.recomputes >= 1
    switched = 0
    for g in groups:
        p = prompts[g.prompt_index]
        for c in g:
            ids = c.completion_ids.tolist()
            k = int((c.versions == 0).sum())
            assert c.versions.tolist() == [0] * k + [1] * (len(ids) - k)
            switched += 0 < k < len(ids)
            assert torch.allclose(c.logprobs[:k].double(), completion_logprobs(model, p, ids[:k]), rtol=1e-9, atol=1e-12)
            assert torch.allclose(c.logprobs[k:].double(), completion_logprobs(b, p + ids[:k], ids[k:]),
                                  rtol=1e-9, atol=1e-12)
    assert switched >= 2


def test_kept_stream_buffers_are_reused_and_reset(model):
    """keep_stream_buffers: a second stream of the same shapes reuses the first one's
    buffers and decode steps (stale K/V and masks reset); outputs equal a fresh engine's."""
    prompts = random_prompts([7, 12, 3, 9], seed=16)
    others = random_prompts([11, 2, 8, 5], seed=17)
    engine = RolloutEngine(model, sync_every=2, static_kv=True, keep_stream_buffers=True)
    first = list(engine.generate_stream(prompts, params(n=2), max_rows=4))
    check_greedy(model, first, prompts, 2)
    kept = engine._stream_arena[1]
    again = list(engine.generate_stream(others, params(n=2), max_rows=4))
    check_greedy(model, again, others, 2)
    assert engine._stream_arena[1]["cache"] is kept["cache"] and engine._stream_arena[1]["steps_cache"] is kept["steps_cache"]
    engine.release_stream_buffers()
    assert engine._stream_arena is None


def test_kept_stream_buffers_hold_shorter_prompts_without_new_steps(model):
    """A trainer's rollouts vary in prompt length: a stream whose prompts fit the kept prompt
    store reuses it (no decode step built again: on CUDA, no capture) and stays exact; a
    longer prompt builds a new arena."""
    engine = RolloutEngine(model, sync_every=2, static_kv=True, keep_stream_buffers=True)
    long_prompts, short_prompts = random_prompts([30, 25], seed=40), random_prompts([9, 4], seed=41)
    check_greedy(model, engine.generate(long_prompts, params(n=2)), long_prompts, 2)
    kept = engine._stream_arena
    check_greedy(model, engine.generate(short_prompts, params(n=2)), short_prompts, 2)
    assert engine.stats.step_builds == 0 and engine._stream_arena[1]["cache"] is kept[1]["cache"]
    longer = random_prompts([50, 3], seed=42)
    check_greedy(model, engine.generate(longer, params(n=2)), longer, 2)
    assert engine.stats.step_builds > 0 and engine._stream_arena[0][2] >= 50


def test_compiled_decode_step_matches_full_forward_float32():
    """compile_decode: the decode blocks through torch.compile (what CUDA captures) give the
    greedy stream of a full forward, logprobs within the float32 standard (1e-5). (In
    float64 inductor's fused kernels differ from eager by ~2e-8, hence float32 here.)"""
    model = tiny_model(dtype=torch.float32, seed=3)
    prompts = random_prompts([7, 12, 3, 9, 20, 4], seed=18)
    engine = RolloutEngine(model, sync_every=2, static_kv=True, compile_decode=True)
    groups = list(engine.generate_stream(prompts, params(n=2), max_rows=4))
    assert engine.decode_blocks.compiled, "compilation fell back to eager"
    check_greedy(model, groups, prompts, 2, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ prefix cache across calls
def test_prefix_cache_next_turn_prefills_only_its_new_tokens(model):
    """Multi-turn: turn 2's prompt extends turn 1's prompt (+ its completion + new tokens);
    with the prefix cache it prefills only the tokens after turn 1's prompt, and its greedy
    output equals a full forward. After a weight update the cache is not used."""
    engine = RolloutEngine(model, sync_every=2, prefix_cache_tokens=1000)
    p1 = random_prompts([13], seed=19)[0]
    [g1] = engine.generate_stream([p1], params(n=2))
    check_greedy(model, [g1], [p1], 2)
    assert engine.stats.prefill_tokens == 13 and engine.stats.prefix_cache_hit_tokens == 0
    p2 = p1 + g1[0].completion_ids.tolist() + [5, 6, 7]
    other = random_prompts([9], seed=20)[0]
    groups = list(engine.generate_stream([p2, other, p1], params(n=2)))
    check_greedy(model, groups, [p2, other, p1], 2)
    s = engine.stats
    assert s.prefix_cache_hit_tokens == 13 + 13  # p2 reuses p1; p1 again: all of it
    assert s.prefill_tokens == (len(p2) - 13) + 9
    # turn 3 extends turn 2: turn 2's entry superseded turn 1's... and p1 was stored again
    p3 = p2 + [1, 2]
    [g3] = engine.generate_stream([p3], params(n=2))
    check_greedy(model, [g3], [p3], 2)
    assert engine.stats.prefill_tokens == 2 and engine.stats.prefix_cache_hit_tokens == len(p2)
    engine.update_weights(model)  # new version: cached K/V are stale
    [g4] = engine.generate_stream([p3], params(n=2))
    assert engine.stats.prefill_tokens == len(p3) and engine.stats.prefix_cache_hit_tokens == 0
    check_greedy(model, [g4], [p3], 2)


def _full_forward(model, tokens):
    """An independent forward of ``tokens`` alone (HF attention, no padding): per layer
    keys/values ``[layers, Hkv, len, D]`` and the logits after the last token."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=True)
    layers = out.past_key_values.layers
    return (torch.stack([l.keys[0] for l in layers]), torch.stack([l.values[0] for l in layers]),
            out.logits[0, -1])


@pytest.mark.parametrize("forward", ["own", "hf", "bucket"])
def test_batched_prefill_of_cached_prefixes_equals_each_sequence_alone(model, forward):
    """One batched prefill (in chunks of 4 query slots) of prefix-cache hits with different
    cached and new lengths (one with nothing new), and misses: every sequence's K/V and
    last logits equal an independent forward of it alone, in float64 — through treerl's own
    blocks (:class:`~treerl.rollout.prefill_blocks.PrefillForward`, the Qwen3 default),
    through the model's HF forward (other families), and in one forward of a fixed bucket
    (:mod:`~treerl.rollout.prefill_graphs`: 8 rows, 16 queries, 256 slots), run twice with
    another prefill between (the buckets share their K/V buffers)."""
    from treerl.rollout.kv import rollout_attention_enabled
    from treerl.rollout.prefix_cache import PrefixEntry

    seqs = random_prompts([20, 9, 31, 5, 17, 12], seed=30)
    cut = [7, 0, 30, 5, 16, 0]  # cached tokens (0: a miss; 5 of 5: nothing new)
    cached = [PrefixEntry(tuple(s[:c]), *_full_forward(model, s[:c]), 0) if c else None for s, c in zip(seqs, cut)]
    if forward == "bucket":
        engine = RolloutEngine(model, prefill_graph_tokens=512)
        with rollout_attention_enabled(model), torch.no_grad():
            engine.prefiller(seqs, cached, engine.stats)
            engine.prefiller(random_prompts([40, 3], seed=29), None, engine.stats)  # 2 rows, 64 queries
    else:
        engine = RolloutEngine(model, prefill_chunk_tokens=24)  # 24 // 6 rows: 4 query slots per forward
    assert engine.prefiller.forward is not None
    if forward == "hf":
        engine.prefiller.forward = None
    engine.stats = RolloutStats()
    with rollout_attention_enabled(model), torch.no_grad():
        cache, lens, logits = engine.prefiller(seqs, cached, engine.stats)
    C = cache.length
    assert lens.tolist() == [len(s) for s in seqs] and logits.shape[0] == len(seqs)
    if forward == "bucket":
        assert C == 256 and engine.stats.prefill_calls == engine.stats.prefill_graph_calls == 1
        assert cache.all_keys.shape[1] == 8 and len(engine.prefiller.graphs._runs) == 2
        engine.release_stream_buffers()  # frees the buckets and buffers: the next prefill makes them again
        assert not engine.prefiller.graphs._runs and engine.prefiller.graphs._keys is None
        with rollout_attention_enabled(model), torch.no_grad():
            again = engine.prefiller(seqs, cached, RolloutStats())
        assert torch.equal(again[2], logits) and again[0].all_keys.data_ptr() != cache.all_keys.data_ptr()
        for i, s in enumerate(seqs):
            assert torch.equal(again[0].all_keys[:, i, :, C - len(s):], cache.all_keys[:, i, :, C - len(s):])
    else:
        assert C == 1 + 31 and engine.stats.prefill_graph_calls == 0
        assert engine.stats.prefill_calls == -(-max(len(s) - c for s, c in zip(seqs, cut)) // 4)
    assert engine.stats.prefill_tokens == sum(len(s) - c for s, c in zip(seqs, cut))
    assert engine.stats.prefix_cache_hit_tokens == sum(cut)
    for i, s in enumerate(seqs):
        keys, values, last = _full_forward(model, s)
        assert torch.allclose(cache.all_keys[:, i, :, C - len(s) :], keys, rtol=1e-9, atol=1e-12), i
        assert torch.allclose(cache.all_values[:, i, :, C - len(s) :], values, rtol=1e-9, atol=1e-12), i
        assert torch.allclose(logits[i], last, rtol=1e-9, atol=1e-12), i


def test_prefix_cache_hits_and_misses_admitted_together(model):
    """Turn 2 of several conversations in one admission: extensions of their turn-1 prompts
    by different numbers of tokens, a repeated prompt (nothing new) and new prompts. The
    whole admission is one batched prefill (or one per piece of prefill_chunk_tokens), only
    new tokens are computed, and greedy outputs equal full forwards."""
    turn1 = random_prompts([13, 4, 22, 9], seed=31)
    for chunk, graph_tokens in ((4096, 0), (4096, 512), (40, 0)):  # one piece (in a bucket); pieces of <= 40 tokens
        engine = RolloutEngine(model, sync_every=3, prefix_cache_tokens=1000, prefill_chunk_tokens=chunk,
                               prefill_graph_tokens=graph_tokens)
        first = {g.prompt_index: g for g in engine.generate_stream(turn1, params(n=2))}
        turn2 = [turn1[0] + first[0][0].completion_ids.tolist() + [3, 1, 4],
                 turn1[1] + [9],
                 turn1[2],  # asked again: nothing new
                 turn1[3] + first[3][1].completion_ids.tolist(),
                 random_prompts([11], seed=32)[0],
                 random_prompts([6], seed=33)[0]]
        groups = list(engine.generate_stream(turn2, params(n=2)))
        check_greedy(model, groups, turn2, 2)
        s = engine.stats
        assert s.admissions == 1 and (s.prefill_calls == 1 if chunk == 4096 else 1 < s.prefill_calls < 6), s
        assert s.prefill_graph_calls == (1 if graph_tokens else 0), s
        assert s.prefix_cache_hit_tokens == sum(len(p) for p in turn1)
        assert s.prefill_tokens == sum(len(a) for a in turn2) - sum(len(p) for p in turn1)


def test_prefill_buckets_follow_where_the_parameters_are():
    """Captured prefills read the parameters at their addresses: an in-place change keeps the
    buckets, a parameter given new storage (a device round trip, ``assign=True`` loads) drops
    them at the next stream's start; greedy outputs equal full forwards either way."""
    model = tiny_model(seed=3)
    engine = RolloutEngine(model, prefill_graph_tokens=512, sync_every=2)
    prompts = random_prompts([9, 14], seed=35)
    check_greedy(model, list(engine.generate_stream(prompts, params(n=2))), prompts, 2)
    graphs = engine.prefiller.graphs
    assert graphs._runs and engine.stats.prefill_graph_calls == 1
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # in place: same storage
    check_greedy(model, list(engine.generate_stream(prompts, params(n=2))), prompts, 2)
    assert graphs._runs and engine.stats.prefill_graph_calls == 1
    runs = dict(graphs._runs)
    with torch.no_grad():
        model.lm_head.weight.data = model.lm_head.weight.data.clone()  # new storage
    check_greedy(model, list(engine.generate_stream(prompts, params(n=2))), prompts, 2)
    assert graphs._runs and all(graphs._runs[b] is not runs[b] for b in graphs._runs)  # made again


def test_prefix_cache_lru_and_superseding():
    from treerl.rollout.prefix_cache import PrefixCache, PrefixEntry

    def entry(tokens, version=0):
        n = len(tokens)
        return PrefixEntry(tuple(tokens), torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2), torch.zeros(3), version)

    c = PrefixCache(max_tokens=10)
    c.insert(entry([1, 2, 3]))
    c.insert(entry([1, 2, 3, 4, 5]))  # extends [1, 2, 3]: supersedes it
    assert len(c) == 1 and c.tokens == 5
    c.insert(entry([7, 8, 9]))
    assert c.lookup([1, 2, 3, 4, 5, 6], 0).tokens == (1, 2, 3, 4, 5)  # now most recently used
    assert c.lookup([1, 2], 0) is None and c.lookup([7, 8], 0) is None
    c.insert(entry([4, 4, 4]))  # 11 tokens: evicts the least recently used, [7, 8, 9]
    assert c.tokens == 8 and c.lookup([7, 8, 9], 0) is None and c.lookup([4, 4, 4, 1], 0) is not None
    assert c.hit_tokens([4, 4, 4, 1], 0) == 3 and c.hit_tokens([4, 4, 4], 1) == 0 and len(c) == 2  # read-only
    c.insert(entry([6, 6]))  # 10 tokens: nothing evicted; hit_tokens did not make [1..5] most recently used
    assert c.hit_tokens([1, 2, 3, 4, 5], 0) == 5 and list(c._entries)[0] == (1, 2, 3, 4, 5)
    assert c.lookup([4, 4, 4], 1) is None and len(c) == 0 and c.tokens == 0  # other weights: all dropped
    c.insert(entry(list(range(11)), 1))  # larger than the cache: not stored
    assert len(c) == 0


@pytest.mark.parametrize("how", ["adamw", "adamw-fused", "update_weights", "load_state_dict"])
def test_fused_projections_follow_every_parameter_update(how):
    """The decode blocks' fused Q/K/V and gate/up copies are refreshed after any in-place
    change of the model's parameters: optimizer steps (the trainer shares its policy with
    the rollout engine; a fused AdamW step bumps no version counter: the next stream's
    start refreshes), update_weights, load_state_dict; and the stream then samples what
    the model gives."""
    model = tiny_model(dtype=torch.float32, seed=4)
    engine = RolloutEngine(model)
    fused = engine.decode_blocks.fused
    if how.startswith("adamw"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=how == "adamw-fused" or None)
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        opt.step()
    elif how == "update_weights":
        engine.update_weights(tiny_model(dtype=torch.float32, seed=5))
    else:
        model.load_state_dict(tiny_model(dtype=torch.float32, seed=6).state_dict())
    prompts = random_prompts([5, 9], seed=2)
    check_greedy(model, list(engine.generate_stream(prompts, params(n=2))), prompts, 2, rtol=1e-5, atol=1e-5)
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        assert torch.equal(fused.qkv_w[i], torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        assert torch.equal(fused.gate_up_w[i], torch.cat([m.gate_proj.weight, m.up_proj.weight]))


def _triton_interprets() -> bool:
    import os

    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - CPU-only installs
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _triton_interprets(), reason="needs triton's interpreter (TRITON_INTERPRET=1); on CUDA: "
                                                     "tests/cuda/test_rollout_cuda.py")
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_kernel_step_matches_the_torch_step(family, monkeypatch):
    """The decode step of the split-key kernels (rope kernel, the prompt part's split attention,
    the own part through the block table merged in its kernel, the small-row products and the tail with the next norm)
    run by Triton's interpreter on the
    CPU in float32: the same greedy tokens as the torch step, logprobs to 1e-5, and every
    step after the first took it."""
    import treerl.rollout.blocks as blocks
    from treerl.rollout.shared import SharedPrefixCache

    model = tiny_model(family, dtype=torch.float32, seed=2, head_dim=16)
    prompts = random_prompts([9, 30, 3, 17], seed=6)
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=12, seed=0, branch_points=[5])
    want = RolloutEngine(model, sync_every=4).generate(prompts, params)
    monkeypatch.setattr(SharedPrefixCache, "backend", lambda self, own_len, prefix_len: "split")
    monkeypatch.setattr(blocks, "merged_attention_ok", lambda *a: True)  # (its probe needs CUDA)
    steps = []
    kernel_step = blocks.DecodeBlocks._kernel_step
    monkeypatch.setattr(blocks.DecodeBlocks, "_kernel_step", lambda self, *a: steps.append(1) or kernel_step(self, *a))
    engine = RolloutEngine(model, sync_every=4)
    got = engine.generate(prompts, params)
    assert engine.decode_blocks.rope_kernel and engine.decode_blocks.small and len(steps) == 11
    for a, b in zip(want, got):
        for x, y in zip(a, b):
            assert x.completion_ids.tolist() == y.completion_ids.tolist()
            assert torch.allclose(x.logprobs, y.logprobs, atol=1e-5)


@pytest.mark.skipif(not _triton_interprets(), reason="needs triton's interpreter (TRITON_INTERPRET=1); on CUDA: "
                                                     "tests/cuda/test_rollout_cuda.py")
def test_kernel_step_of_a_few_long_conversations_matches_the_torch_step(monkeypatch):
    """Two served conversations (rows of one, their prompts of 150-200 tokens in their own
    blocks): the kernel step runs the own part in several key ranges merged by merge_ranges,
    and gives the torch step's greedy tokens and logprobs to 1e-5 (Triton's interpreter, float32)."""
    import treerl.rollout.blocks as blocks
    import treerl.rollout.shared as shared

    model = tiny_model("qwen3", dtype=torch.float32, seed=2, head_dim=16, max_position_embeddings=256)
    prompts = random_prompts([150, 200], seed=9)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=10, seed=0)
    want = RolloutEngine(model, sync_every=4).generate(prompts, params)
    monkeypatch.setattr(shared.SharedPrefixCache, "backend", lambda self, own_len, prefix_len: "split")
    monkeypatch.setattr(blocks, "merged_attention_ok", lambda *a: True)  # (its probe needs CUDA)
    merges = []
    merge_ranges = shared.merge_ranges
    monkeypatch.setattr(shared, "merge_ranges", lambda *a: merges.append(a[0].shape[2]) or merge_ranges(*a))
    engine = RolloutEngine(model, sync_every=4)
    got = engine.generate(prompts, params)
    assert merges and min(merges) > 1, merges  # (several key ranges in every merged call)
    for a, b in zip(want, got):
        assert a[0].completion_ids.tolist() == b[0].completion_ids.tolist()
        assert torch.allclose(a[0].logprobs, b[0].logprobs, atol=1e-5)


def test_own_part_merged_in_its_kernel_only_where_rows_fill_the_gpu(monkeypatch):
    """The kernel step's own part: one key range per row merged in its kernel with the prompt part's ranges while
    rows x KV heads give every SM a program or the keys fit one tile; a few rows over long own keys (served
    conversations) run in key ranges instead, merged by merge_ranges (merge_parts in one kernel)."""
    from types import SimpleNamespace

    import treerl.rollout.shared as shared

    calls, ranges = [], []

    def split(q, k, v, mask, scale, table=None):  # the own part's 3 key ranges
        calls.append("split")
        ranges[:] = [torch.randn(q.shape[0], q.shape[1], 3, q.shape[2], 16), torch.randn(*q.shape[:2], 3, q.shape[2])]
        return tuple(ranges)

    monkeypatch.setattr(shared, "split_attention", split)
    monkeypatch.setattr(shared, "split_attention_merged", lambda *a, **k: calls.append("merged") or "merged")
    monkeypatch.setattr(shared, "merge_ranges", shared.merge_parts)  # (the kernel: test_rollout_paging.py)
    # (8 KV heads: 16 rows give 128 programs, under MERGED_MIN_PROGRAMS; 17 rows or more fill the GPU in one range
    # each, over any span: session 16 measured served conversations faster so than in ranges)
    for rows, keys, kernel in ((64, 512, "merged"), (2, 64, "merged"), (2, 2048, "split"), (8, 256, "split"),
                               (16, 1024, "split"), (17, 1024, "merged"), (64, 1024, "merged"), (128, 1024, "merged")):
        cache = SimpleNamespace(layers=[SimpleNamespace(ok=None, ov=None)], table=torch.zeros(rows, 4))
        q = torch.randn(rows, 8, 2, 16)
        o_pre, l_pre = torch.randn(rows // 2, 8, 2, 4, 16), torch.randn(rows // 2, 8, 2, 4)
        calls.clear()
        got = shared.SharedPrefixCache.attend_own_merged(cache, 0, q, torch.zeros(rows, 1, 1, keys), 0.25, o_pre,
                                                         l_pre, 2, torch.float32)
        assert calls == [kernel], (rows, keys, calls)
        if kernel == "split":
            assert torch.equal(got, shared.merge_parts(*ranges, o_pre, l_pre, 2, torch.float32))


def test_merged_attention_probe_warns_when_it_fails(monkeypatch):
    """The merged attention kernels' probe (its CUDA check aside): False, with a warning naming
    the failure, when the kernel fails or disagrees with merge_parts, or the merge of the own
    part's key ranges (merge_ranges) fails."""
    import treerl.rollout.shared as shared

    monkeypatch.setattr(shared, "split_attention_ok", lambda *a: True)
    probe = shared.merged_attention_ok.__wrapped__

    def fails(*a, **k):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(shared, "split_attention_merged", fails)
    with pytest.warns(UserWarning, match="merged attention kernels failed .*no kernel"):
        assert not probe("cpu", torch.float32, 16, 16)
    monkeypatch.setattr(shared, "split_attention_merged", lambda *a: torch.zeros(6, 1, 4, 16))
    with pytest.warns(UserWarning, match="merged attention kernels disagreed"):
        assert not probe("cpu", torch.float32, 16, 16)

    def exact(q, k, v, mask, scale, o2, l2, G, dtype):  # the own part in one range, merged exactly
        o, lse = shared._attend_math(q.double(), k.double(), v.double(), mask.double(), scale)
        return shared.merge_parts(o.unsqueeze(2), lse.unsqueeze(2), o2.double(), l2.double(), G, dtype)

    def no_merge(*a):
        raise RuntimeError("no merge")

    monkeypatch.setattr(shared, "split_attention_merged", exact)
    monkeypatch.setattr(shared, "split_attention", lambda q, k, v, mask, scale, splits: (q[..., :1], q[..., 0]))
    monkeypatch.setattr(shared, "merge_ranges", no_merge)
    with pytest.warns(UserWarning, match="merged attention kernels failed .*no merge"):
        assert not probe("cpu", torch.float32, 16, 16)


def test_prefill_runs_in_a_captured_bucket_that_holds_it():
    """A shape whose own bucket has no graph runs in the smallest captured bucket that holds it
    (at most COVER_PADDING x its query slots and K/V slots) instead of capturing one; an uncaptured bucket
    covers nothing, and without graphs every shape keeps its own bucket."""
    from types import SimpleNamespace

    from treerl.rollout.prefill_graphs import COVER_PADDING, PrefillBucket, PrefillGraphs

    graphs = PrefillGraphs(None, None, 1, (1, 16, 16), torch.float32, torch.device("cpu"), 2048, use_graphs=True)
    captured, uncaptured = SimpleNamespace(graph=object()), SimpleNamespace(graph=None)
    graphs._runs = {PrefillBucket(8, 64, 512): captured, PrefillBucket(4, 64, 512): captured,
                    PrefillBucket(16, 128, 256): uncaptured}
    assert graphs.bucket(3, 30, 300) == PrefillBucket(4, 64, 512)  # own (4, 32, 512): 2x padding, the smallest
    assert graphs.bucket(5, 64, 257) == PrefillBucket(8, 64, 512)
    assert graphs.bucket(2, 16, 256) == PrefillBucket(2, 16, 256)  # 8x padding: > COVER_PADDING (4), its own
    assert graphs.bucket(9, 100, 200) == PrefillBucket(16, 128, 256)  # not captured: its own (captured at its use)
    assert graphs.bucket(4, 40, 600) == PrefillBucket(4, 64, 1024)  # no captured bucket holds its slots
    assert graphs.bucket(4, 64, 512) == PrefillBucket(4, 64, 512) and COVER_PADDING == 4
    graphs._runs[PrefillBucket(1, 64, 8192)] = captured
    assert graphs.bucket(1, 16, 200) == PrefillBucket(1, 16, 256)  # (1, 64, 8192): 32x its K/V slots, its own
    assert graphs.bucket(1, 40, 3000) == PrefillBucket(1, 64, 8192)  # own (1, 64, 4096): 2x
    graphs.use_graphs = False
    assert graphs.bucket(3, 30, 300) == PrefillBucket(4, 32, 512)


def test_prefill_in_a_larger_bucket_equals_each_sequence_alone(model):
    """The prefill of cache hits and misses laid out in a bucket larger than its own in every
    dimension (what a captured bucket that holds it runs): every sequence's K/V and last
    logits equal an independent forward of it alone, in float64."""
    from treerl.rollout.kv import rollout_attention_enabled
    from treerl.rollout.prefill_graphs import PrefillBucket
    from treerl.rollout.prefix_cache import PrefixEntry

    seqs = random_prompts([20, 9, 31, 5, 17], seed=31)
    cut = [7, 0, 30, 5, 0]
    cached = [PrefixEntry(tuple(s[:c]), *_full_forward(model, s[:c]), 0) if c else None for s, c in zip(seqs, cut)]
    engine = RolloutEngine(model, prefill_graph_tokens=2048)  # own bucket (8, 32, 256); run in (16, 64, 512)
    graphs = engine.prefiller.graphs
    own = graphs.bucket
    graphs.bucket = lambda rows, window, slots: PrefillBucket(2 * own(rows, window, slots).rows, 2 * own(
        rows, window, slots).window, 2 * own(rows, window, slots).slots)
    with rollout_attention_enabled(model), torch.no_grad():
        cache, lens, logits = engine.prefiller(seqs, cached, engine.stats)
    C = cache.length
    assert C == 512 and cache.all_keys.shape[1] == 16 and engine.stats.prefill_graph_calls == 1
    for i, s in enumerate(seqs):
        keys, values, last = _full_forward(model, s)
        assert torch.allclose(cache.all_keys[:, i, :, C - len(s) :], keys, rtol=1e-9, atol=1e-12), i
        assert torch.allclose(cache.all_values[:, i, :, C - len(s) :], values, rtol=1e-9, atol=1e-12), i
        assert torch.allclose(logits[i], last, rtol=1e-9, atol=1e-12), i


def test_an_admission_joins_only_what_fits_one_captured_prefill(model):
    """While a group decodes, with captured prefills, prompts that fit a bucket each but not
    together are admitted one per turn, each prefill in its bucket, where they were one prefill
    too large for any bucket (run eagerly with every running row waiting: session 21). With
    nothing decoding, or without captured prefills, they are one prefill as before. Greedy
    outputs equal the reference."""
    prompts = random_prompts([5, 40, 38, 36], seed=39)  # 40/38/36: a window of 64 queries, 256 slots each
    long = SamplingParams(n=1, temperature=0, max_new_tokens=MAX_NEW)  # no stop: decodes MAX_NEW steps
    for graph_tokens in (64, 0):  # 64: a bucket holds one of them (64 queries, 256 slots), not two
        engine = RolloutEngine(model, sync_every=1, prefill_graph_tokens=graph_tokens)
        sizes = prefill_sizes(engine)
        queue = PromptQueue()
        arrived = threading.Event()

        def first_tokens(delta, queue=queue, arrived=arrived):  # (the others arrive while group 0 decodes)
            if not arrived.is_set():
                arrived.set()
                queue.put_many([(i, p) for i, p in enumerate(prompts) if i])
                queue.close()

        queue.put(prompts[0], 0, params=long, listener=first_tokens)
        groups = {g.prompt_index: g for g in engine.generate_stream(queue, params(n=1), max_rows=8)}
        s = engine.stats
        if graph_tokens:  # the oldest waiting prompt first in each turn (none of the others fits beside it)
            assert sizes == [[5], [40], [38], [36]] and s.prefill_calls == s.prefill_graph_calls == 4, (sizes, s)
        else:
            assert sizes == [[5], [36, 38, 40]] and s.prefill_graph_calls == 0, (sizes, s)
        for i in range(1, 4):
            assert groups[i][0].completion_ids.tolist() == greedy_reference(model, prompts[i]), i
        sizes.clear()  # nothing decoding: one prefill (too large for a bucket: eager), nobody waits for it
        burst = {g.prompt_index: g for g in engine.generate_stream(prompts[1:], params(n=1), max_rows=8)}
        assert sizes == [[36, 38, 40]], sizes
        for i in range(3):
            assert burst[i][0].completion_ids.tolist() == greedy_reference(model, prompts[i + 1]), i
