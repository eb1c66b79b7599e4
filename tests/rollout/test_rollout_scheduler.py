"""The running batch's host side alone (no model, no device tensors): admission by free
blocks, sampled tokens and stops, preemption and readmission, forks, compaction."""

import numpy as np
import torch

import dataclasses

from treerl.rollout import SamplingParams, ForkLayout
from treerl.rollout.log_reads import check_stops, record
from treerl.rollout.prompts import Waiting
from treerl.rollout.scheduler import ROW_STATE, Preempted, Scheduler, group_bucket, own_bucket
from treerl.rollout.types import RolloutStats

STOP = 99


def scheduler(params: SamplingParams, groups: int, num_blocks: int, sync_every: int = 4, block: int = 16):
    tree = ForkLayout.of(params)
    max_blocks = -(-tree.own_capacity // block)
    s = Scheduler(tree, dataclasses.replace(params, stop_token_ids=[STOP]), block, max_blocks, sync_every,
                  exact=True, stats=RolloutStats())
    s.reset(groups, num_blocks)
    return s


def admit(s: Scheduler, keys, prompts, slots, version=0, params=None):
    items = [Waiting(k, p, params) for k, p in zip(keys, prompts)]
    return s.admit(items, prompts, np.asarray(slots), version)


def step(s: Scheduler, tokens: dict[int, int]) -> None:
    """Every live row samples a token (``tokens[row]``, default 1) and feeds it; synced."""
    rows = np.flatnonzero(s.live)
    s.fed_h[s.live] += 1
    s.logged(rows)
    tok = np.zeros((1, s.S), np.int64)
    lp = np.zeros((1, s.S))
    for r in rows:
        tok[0, r] = tokens.get(int(r), 1)
        lp[0, r] = -0.5
    record(s, s.take_log(), tok, lp)
    check_stops(s)


def test_rows_longer_than_the_first_host_width_widen_it():
    """A row past 256 tokens widens the host arrays (the [S, width] ones and the [S, width, k] top ones)."""
    s = scheduler(SamplingParams(n=1, max_new_tokens=600), groups=1, num_blocks=40)
    admit(s, [0], [[1]], [0])
    for _ in range(300):
        step(s, {})
    assert s.host_tok.shape[1] == 512 and s.top_id.shape[:2] == (1, 512) and s.steps.tolist() == [300]
    assert (s.host_tok[0, :300] == 1).all() and (s.host_lp[0, :300] == -0.5).all()


def test_buckets():
    assert group_bucket(3, 16, 2) == 4 and group_bucket(1, 16, 2) == 4 and group_bucket(3, 16, 2, exact=True) == 3
    assert group_bucket(9, 10, 1) == 10 and own_bucket(65, 256) == 128 and own_bucket(65, 100) == 100
    assert own_bucket(65, 256, exact=True) == 65
    # past 16 x 64 slots the grain doubles with the span (fewer decode graphs; at most 12.5% over)
    assert [own_bucket(n, 1 << 20) for n in (1024, 1025, 1100, 2048, 2049, 4097, 8000)] == [
        1024, 1152, 1152, 2048, 2304, 4608, 8192]
    spans = range(1, 4097)
    assert len({own_bucket(n, 1 << 20) for n in spans}) == 32 and all(
        n <= own_bucket(n, 1 << 20) <= max(64 * -(-n // 64), n * 1.125) for n in spans)


def test_admission_by_free_blocks_and_stops_free_them():
    s = scheduler(SamplingParams(n=2, max_new_tokens=40), groups=3, num_blocks=5)
    assert s.blocks_needed(None) == 2  # one block each for the two first rows' next 4 tokens
    items = [Waiting("a", [1, 2]), Waiting("b", [3]), Waiting("c", [4, 5, 6])]
    fit = s.fit_blocks(items)
    assert [w.key for w in fit] == ["a", "b"] and list(s.deferred) == [items[2]]  # 5 free: 2 + 2, then 1 < 2
    first = admit(s, ["a", "b"], [[1, 2], [3]], [0, 1], version=7)
    assert first.tolist() == [0, 1, 2, 3] and s.live.tolist() == [True] * 4 + [False] * 2
    assert s.blocks.owned.tolist() == [1, 1, 1, 1, 0, 0] and s.blocks.free == 1 and not s.room()
    assert s.gkey == ["a", "b", None] and s.row_version[:4].tolist() == [7] * 4 and s.stats.admitted == 2
    step(s, {0: 5})
    step(s, {0: STOP, 2: STOP, 3: STOP})  # row 0 stops; group b's both rows too
    assert s.live.tolist() == [False, True, False, False, False, False]
    [done] = s.out
    assert done.prompt_index == "b" and [c.finish_reason for c in done] == ["stop", "stop"]
    assert done[0].completion_ids.tolist() == [1, STOP] and done[0].logprobs.tolist() == [-0.5, -0.5]
    assert done[0].versions.tolist() == [7, 7] and done[0].stop == STOP and done[0].branch == (0,)
    assert s.gkey == ["a", None, None] and s.blocks.free == 4 and s.room()
    s.blocks.check()


def test_length_limit_finishes_the_group():
    s = scheduler(SamplingParams(n=1, max_new_tokens=3), groups=2, num_blocks=2)
    admit(s, [0], [[1]], [0], version=0)
    for _ in range(3):
        assert not s.ending.any()
        step(s, {})
    [g] = s.out
    assert g[0].finish_reason == "length" and len(g[0]) == 3 and s.stats.generated_tokens == 3
    assert s.blocks.free == 2


def test_make_room_preempts_the_latest_group_and_readmit_restores_it():
    s = scheduler(SamplingParams(n=1, max_new_tokens=48), groups=2, num_blocks=3, sync_every=1)
    admit(s, ["old"], [[1]], [0], version=0)
    admit(s, ["new"], [[2]], [1], version=0)
    for _ in range(16):
        assert s.grow_for_step()
        step(s, {1: 3})
    assert s.blocks.owned.tolist() == [1, 1] and s.blocks.free == 1
    assert not s.grow_for_step()  # both rows need a 2nd block, one is free
    before = {name: getattr(s, name)[1].copy() for name in ROW_STATE}
    s.make_room()
    assert s.gkey == ["old", None] and s.stats.preemptions == 1 and s.blocks.owned.tolist() == [2, 0]
    [item] = s.deferred
    assert isinstance(item, Preempted) and item.key == "new" and item.prompt == [2] and item.keys == ["new"]
    assert s.blocks_needed(item) == 2  # its past tokens' block and the next window's
    s.deferred.clear()
    s.finish(0, 16, "length", None)  # the old group ends: its blocks come back
    live = s.readmit(item, 0)
    assert live.tolist() == [0] and s.gkey == ["new", None] and s.blocks.owned.tolist() == [2, 0]
    for name in ROW_STATE:
        assert (getattr(s, name)[0] == before[name]).all(), name
    seqs, group_src, row_src, plen = s.reload_plan(np.asarray([0]))
    assert seqs == [[2] + [3] * 15] and group_src == [0] and row_src == [0] and plen == [1]
    s.blocks.check()


def test_forks_copy_the_parent_rows():
    p = SamplingParams(n=2, max_new_tokens=16, branch_points=[3], branch_factor=2)
    s = scheduler(p, groups=1, num_blocks=8)
    admit(s, ["t"], [[1]], [0], version=0)
    assert s.live.tolist() == [True, False, True, False]  # the 2 samples' first rows
    for t in range(3):
        assert s.due_forks() == []
        step(s, {0: 10 + t, 2: 20 + t})
    assert s.due_forks() == [0]
    par, kid = s.fork([0])
    assert par.tolist() == [0, 2] and kid.tolist() == [1, 3] and s.live.all() and s.level[0] == 1
    assert s.host_tok[1, :3].tolist() == [10, 11, 12] and s.host_tok[3, :3].tolist() == [20, 21, 22]
    assert s.blocks.owned[[1, 3]].tolist() == [0, 0] and s.stats.forks == 2 and s.key == ["t"] * 4
    for r in range(4):
        s.finish(r, 5, "length", None)
    [g] = s.out
    assert [c.branch for c in g] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_compaction_moves_groups_down():
    s = scheduler(SamplingParams(n=1, max_new_tokens=32), groups=4, num_blocks=8)
    admit(s, list("abcd"), [[1], [2], [3], [4]], np.arange(4), version=0)
    step(s, {})
    for r in (0, 1):
        s.finish(r, 1, "length", None)
    owned = s.blocks.table[[2, 3]].copy()
    src, dst = s.compact()
    assert src.tolist() == [2, 3] and dst.tolist() == [0, 1] and s.hg == 2
    assert s.gkey == ["c", "d", None, None] and s.key == ["c", "d", None, None]
    assert s.live.tolist() == [True, True, False, False] and (s.blocks.table[[0, 1]] == owned).all()
    assert s.compact() is None and s.hg == 2
    s.blocks.check()


def test_compaction_waits_for_a_sync():
    s = scheduler(SamplingParams(n=1, max_new_tokens=32), groups=4, num_blocks=8)
    admit(s, list("ab"), [[1], [2]], [2, 3], version=0)
    s.logged(np.flatnonzero(s.live))  # logged, not synced: the rows may not move
    assert s.compact() is None and s.hg == 4
    assert torch.equal(s.groups["a"].prompt_ids, torch.tensor([1]))


def test_abort_running_preempted_and_waiting_groups():
    """Cancelled groups come out with "abort": a running one with its tokens so far (its
    blocks freed), a preempted one from its saved rows, a waiting one with n empty samples;
    listeners get the last deltas, which concatenate to the completions."""
    s = scheduler(SamplingParams(n=1, max_new_tokens=32), groups=3, num_blocks=8)
    deltas = []
    items = [Waiting(k, [1], SamplingParams(n=1, max_new_tokens=32), deltas.append) for k in "abc"]
    s.admit(items, [[1], [1], [1]], np.arange(3), version=0)
    for t in range(3):
        step(s, {0: 5 + t, 1: 6, 2: 7})
    s.preempt(2)
    s.deferred.append(Waiting("d", [4, 4], SamplingParams(n=2, max_new_tokens=8)))
    assert [s.abort(k) for k in "abde"] == [True, True, True, False]
    out = {g.prompt_index: g for g in s.out}
    assert out["a"][0].completion_ids.tolist() == [5, 6, 7] and out["a"][0].finish_reason == "abort"
    assert out["b"][0].completion_ids.tolist() == [6, 6, 6]
    assert [len(c) for c in out["d"]] == [0, 0] and {c.finish_reason for c in out["d"]} == {"abort"}
    assert s.gkey == [None, None, None] and len(s.deferred) == 1 and s.blocks.free == 8
    for k in "ab":
        mine = [d for d in deltas if d.prompt_index == k]
        assert sum((d.token_ids for d in mine), []) == out[k][0].completion_ids.tolist()
        assert mine[-1].finish_reason == "abort"
    assert s.abort("c") and not s.deferred and s.out[-1][0].completion_ids.tolist() == [7, 7, 7]
    assert s.out[-1][0].finish_reason == "abort" and "c" not in s.groups


def test_rows_end_at_max_new_without_a_read_and_stopped_rows_drop_later_tokens():
    """Reads of the log lag behind the steps (CUDA): a row at ``max_new`` stops decoding at
    once (not live, ending; its slot stays taken) and finishes when its tokens are read; a
    row whose stop arrives in a read while it decoded on has its later logged tokens dropped."""
    s = scheduler(SamplingParams(n=1, max_new_tokens=2), groups=2, num_blocks=4)
    admit(s, ["a", "b"], [[1], [2]], [0, 1])
    rows = np.flatnonzero(s.live)
    assert not s.logged(rows)  # each row's first token
    first = s.take_log()  # its read starts (in flight)
    assert s.logged(rows)  # the second: both at max_new
    assert not s.live.any() and s.ending[:2].all() and s.sync_due() and s.gkey == ["a", "b"]
    tok, lp = np.array([[STOP, 7]]), np.full((1, s.S), -0.5)
    record(s, first, tok, lp)  # the first read completes: row 0 stopped at its first token
    assert check_stops(s)
    [a] = s.out
    assert a.prompt_index == "a" and a[0].completion_ids.tolist() == [STOP] and a[0].finish_reason == "stop"
    assert [r.tolist() for r, _ in s.log_rows] == [[1]] and s.gkey == [None, "b"] and s.ending.tolist() == [False, True]
    record(s, s.take_log(), np.array([[0, 8]]), lp)
    assert check_stops(s) and not s.ending.any()
    b = s.out[1]
    assert b[0].completion_ids.tolist() == [7, 8] and b[0].finish_reason == "length" and s.blocks.free == 4


def test_readmission_into_a_rebuilt_batch_widens_its_host_arrays():
    """A group preempted after its host arrays grew (300 tokens, top logprobs) is readmitted into
    a batch rebuilt since (narrow arrays again): its rows come back whole."""
    p = SamplingParams(n=1, max_new_tokens=600, top_logprobs=5)
    s = scheduler(SamplingParams(n=1, max_new_tokens=600), groups=2, num_blocks=40)
    admit(s, ["g"], [[1]], [0], params=p)
    for _ in range(300):
        step(s, {})
    assert s.host_tok.shape[1] == 512 and s.top_id.shape[2] == 20
    before = {name: getattr(s, name)[0].copy() for name in ROW_STATE}
    s.preempt(0)
    [item] = s.deferred
    s.deferred.clear()
    s.reset(2, 40)  # the batch rebuilt (e.g. for a longer prompt): arrays 256 wide, no top logprobs
    assert s.host_tok.shape[1] == 256 and s.top_id.shape[2] == 0
    assert s.readmit(item, 1).tolist() == [1]
    for name in ROW_STATE:
        assert (getattr(s, name)[1] == before[name]).all(), name
