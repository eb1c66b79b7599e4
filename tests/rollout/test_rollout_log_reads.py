"""Reads of the decode log (``treerl.rollout.log_reads``), finished ``READ_LAG`` decode steps after
they start: no group is lost or changed when rows end, stop or are rebuilt around a read in
flight, and the schedule depends on step counts only."""

from __future__ import annotations

import pytest

from helpers.models import tiny_model
from helpers.rollout import greedy_reference, random_prompts, sampling
from treerl.rollout import PromptQueue, RolloutEngine, SamplingParams, log_reads


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("max_new,sync_every,max_rows", [(1, 4, 4), (2, 4, 4), (12, 4, 3), (12, 1, 2), (7, 3, 5)])
def test_every_group_comes_out_whatever_ends_when(model, max_new, sync_every, max_rows):
    """Rows that end at their admission sample (``max_new_tokens`` 1), at ``max_new`` or at a stop,
    in every order against the reads: every group is yielded once, equal to a per-prompt
    greedy forward (a stream over a list ends only when every token has been read)."""
    prompts = random_prompts([5, 3, 7, 4, 6, 2], seed=1)
    engine = RolloutEngine(model, sync_every=sync_every)
    groups = list(engine.generate_stream(prompts, sampling(max_new, n=1), max_rows=max_rows))
    assert sorted(g.prompt_index for g in groups) == list(range(len(prompts)))
    for g in groups:
        assert g[0].completion_ids.tolist() == greedy_reference(model, prompts[g.prompt_index], max_new)


@pytest.mark.parametrize("case", ["closed", "rebuilt"])
def test_a_read_in_flight_when_the_last_live_rows_finish(model, monkeypatch, case):
    """Group A ends by length (6 tokens) while group B stops at 5: when the read with B's stop
    finishes B, A's rows are ending and the read of their last token is in flight.
    ``closed``: the queue is closed and empty: the stream still yields A. ``rebuilt``: a
    prompt arrives then that needs the batch rebuilt for its length: the batch reads A's
    tokens first, and every group equals its reference."""
    queue = PromptQueue(idle_timeout=0.5) if case == "rebuilt" else PromptQueue()
    long_prompt = random_prompts([700], seed=99)[0]
    seen = []
    due = log_reads.LogReader.due

    def finishing(self, steps):
        due(self, steps)
        h = self.host
        if not seen and not h.live.any() and h.ending.any() and self.unsynced():
            seen.append(True)  # the state this test is about was reached
            if case == "rebuilt":
                queue.put(long_prompt, key="long")

    monkeypatch.setattr(log_reads.LogReader, "due", finishing)
    stream = sampling(8, length=lambda ids: 5)
    pa, pb = random_prompts([5, 7], seed=3)
    queue.put(pa, key="A", params=SamplingParams(n=2, temperature=0, max_new_tokens=6))
    queue.put(pb, key="B")
    if case == "closed":
        queue.close()
    engine = RolloutEngine(model, sync_every=1, max_batch_tokens=1200)
    groups = {g.prompt_index: g for g in engine.generate_stream(queue, stream, max_rows=4)}
    assert seen and set(groups) == ({"A", "B", "long"} if case == "rebuilt" else {"A", "B"})
    assert [len(c) for c in groups["A"]] == [6, 6] and [c.finish_reason for c in groups["A"]] == ["length"] * 2
    assert all(c.completion_ids.tolist() == greedy_reference(model, pb, 8, length=lambda ids: 5) for c in groups["B"])
    if case == "rebuilt":
        want = greedy_reference(model, long_prompt, 8, length=lambda ids: 5)
        assert [c.completion_ids.tolist() for c in groups["long"]] == [want, want]


def test_reads_finish_read_lag_decode_steps_after_they_start(model, monkeypatch):
    """Each read is finished at the first turn after ``READ_LAG`` more decode steps were queued
    (so the device has steps to run while the host waits for the copy and finishes rows):
    never later; earlier only at a blocking sync (nothing decoding) or when ``READ_LAG`` reads
    are in flight; the samples of a seeded stream are the same run after run."""
    gaps = []
    oldest = log_reads.LogReader._finish_oldest

    def finishing(self):
        gaps.append(engine.stats.decode_steps - self.flight[0][1])
        oldest(self)

    monkeypatch.setattr(log_reads.LogReader, "_finish_oldest", finishing)
    prompts = random_prompts([5, 3, 7, 4, 6, 2], seed=2)
    runs = []
    for _ in range(2):
        engine = RolloutEngine(model, sync_every=2)
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=7)  # (the stream's generator)
        runs.append({g.prompt_index: [c.completion_ids.tolist() for c in g]
                     for g in engine.generate_stream(prompts, params, max_rows=6)})
    assert runs[0] == runs[1] and len(runs[0]) == len(prompts)
    lag = log_reads.READ_LAG
    assert gaps and set(gaps) <= set(range(lag + 1)) and gaps.count(lag) > len(gaps) // 2


@pytest.mark.parametrize("sync_every,max_rows", [(1, 2), (1, 3), (2, 3)])
def test_a_row_finished_while_a_later_read_holds_its_tokens(model, monkeypatch, sync_every, max_rows):
    """With ``READ_LAG`` reads in flight, a read can finish a row (its stop) while a later read
    still holds tokens the row decoded past it; its slot then takes the next prompt before that
    read is recorded. The later read's entries of the finished row are dropped: no recorded
    token lands in a row that is neither live nor ending, and every group equals its greedy
    reference (the case happens in these runs: counted)."""
    from treerl.rollout import scheduler

    dropped, stray = [0], [0]
    finish, record = scheduler.Scheduler.finish, log_reads.record

    def finishing(self, r, *args):
        dropped[0] += sum(int((rows == r).sum()) for read in self.in_flight for rows, _ in read)
        finish(self, r, *args)

    def recording(s, log_rows, *out):
        stray[0] += sum(int((~(s.live[rows] | s.ending[rows])).sum()) for rows, _ in log_rows)
        record(s, log_rows, *out)

    monkeypatch.setattr(scheduler.Scheduler, "finish", finishing)
    monkeypatch.setattr(log_reads, "record", recording)
    prompts = random_prompts([5, 3, 7, 4, 6, 2, 5, 6, 3, 4], seed=1)
    engine = RolloutEngine(model, sync_every=sync_every)
    groups = list(engine.generate_stream(prompts, sampling(12, n=1), max_rows=max_rows))
    assert sorted(g.prompt_index for g in groups) == list(range(len(prompts)))
    for g in groups:
        assert g[0].completion_ids.tolist() == greedy_reference(model, prompts[g.prompt_index], 12)
    assert dropped[0] > 0 and stray[0] == 0
