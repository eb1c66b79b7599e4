"""The staleness controller and sample buffer under random interleavings of launch,
finish (random generation lengths, weight updates mid-generation) and train-step events
(hypothesis): no too-stale unit is ever trained on, the launch bound always holds, the
system never deadlocks, and eta = 0 is synchronous."""

from dataclasses import dataclass
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treerl.async_rl import SampleBuffer, StalenessController, StalenessError


@dataclass
class Gen:
    """A unit being generated: launched at ``launch_version``; ``oldest`` is the version of
    the weights its first token used (>= launch version: workers wait for it)."""

    uid: int
    launch_version: int
    steps_left: int
    oldest: int | None = None


# The strategies drawn from, built once (a new strategy is validated at its first draw: ~10%
# of a run when every event built its own); the draws are the same.
KINDS = st.sampled_from(["launch", "progress", "train"])
LENGTHS = st.one_of(st.integers(0, 3), st.integers(10, 40))  # random (long-tailed) generation length in events


@cache
def ints(lo: int, hi: int):
    return st.integers(lo, hi)


def simulate(data, eta: int, batch: int, n_events: int):
    """One run of ``n_events`` random events: (controller, trained, batches). One
    ``data.draw`` of :func:`simulation`: the events' draws go straight to the test case's
    data (``st.data()``'s own draw, with its per-draw bookkeeping, took half of the time)."""
    return data.draw(simulation(eta, batch, n_events))


@st.composite
def simulation(draw, eta: int, batch: int, n_events: int):
    c = StalenessController(max_staleness=eta, batch_size=batch, version=draw(ints(0, 3)))
    buf = SampleBuffer()
    running: list[Gen] = []
    requeued: list[int] = []
    next_uid = 0
    trained: list[tuple[int, int, int]] = []  # (uid, oldest version, trainer version)
    batches: list[list[Gen]] = []
    launched_at: dict[int, int] = {}
    for _ in range(n_events):
        # the controller's bound: buffered + in flight never exceed (eta + 1) batches
        assert c.accepted + c.running <= (eta + c.steps + 1) * batch
        assert c.capacity() >= 0 and c.running == len(running) and c.buffered == len(buf)
        if not running and not buf.ready(c):
            assert c.capacity() >= 1, "deadlock: nothing running, nothing to train, nothing launchable"
        kind = draw(KINDS)
        if kind == "launch" and c.capacity() > 0:
            n = draw(ints(1, c.capacity()))
            version = c.launch(n)
            for _ in range(n):
                uid = requeued.pop() if requeued else next_uid
                next_uid = max(next_uid, uid + 1)
                launched_at[uid] = version
                length = draw(LENGTHS)
                running.append(Gen(uid, version, length))
        elif kind == "progress" and running:
            g = running[draw(ints(0, len(running) - 1))]
            if g.oldest is None:  # first token: the worker has weights >= launch version
                g.oldest = draw(ints(g.launch_version, c.version))
            g.steps_left -= 1
            if g.steps_left < 0:
                running.remove(g)
                if c.finish(g.oldest):
                    buf.add(g.uid, g.oldest, g)
                else:
                    requeued.append(g.uid)
        elif kind == "train" and buf.ready(c):
            got, evicted = buf.take_batch(c)
            requeued.extend(f.uid for f in evicted)
            if got:
                assert len(got) == batch
                for f in got:
                    assert c.version - f.oldest_version <= eta, "trained a too-stale unit"
                    trained.append((f.uid, f.oldest_version, c.version))
                batches.append([f.payload for f in got])
                c.step()
    uids = [u for u, _, _ in trained]
    assert len(uids) == len(set(uids)), "a unit was trained twice"
    return c, trained, batches


@settings(max_examples=300, deadline=None)
@given(data=st.data(), eta=st.integers(0, 4), batch=st.integers(1, 6))
def test_staleness_bound_holds_under_random_interleavings(data, eta, batch):
    simulate(data, eta, batch, n_events=200)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), batch=st.integers(1, 6))
def test_eta_zero_is_synchronous(data, batch):
    """eta = 0: every unit of a batch was launched at the trainer's current version and
    all its tokens come from it; nothing is ever rejected."""
    c, trained, batches = simulate(data, 0, batch, n_events=200)
    for uid, oldest, version in trained:
        assert oldest == version
    for b in batches:
        assert len({g.launch_version for g in b}) == 1
    assert c.rejected == 0


def test_a_unit_that_finishes_too_late_is_rejected_at_arrival():
    """eta = 1, batch 1: A and B launch at v0; B is trained (v1); C launches at v1 and is
    trained (v2); A finishes last, its tokens 2 versions old: refused, not buffered."""
    c = StalenessController(max_staleness=1, batch_size=1)
    assert c.launch(2) == 0
    assert c.finish(0)  # B
    c.step()
    assert c.capacity() == 1 and c.launch(1) == 1  # C
    assert c.finish(1)
    c.step()
    assert not c.finish(0)  # A
    assert c.rejected == 1 and c.buffered == 0 and c.capacity() == 2


def test_buffer_evicts_units_that_aged_and_trains_oldest_first():
    c = StalenessController(max_staleness=1, batch_size=2, version=3)
    c.launch(4)
    for v in (3, 3, 3, 3):
        assert c.finish(v)
    buf = SampleBuffer()
    for uid in range(4):
        buf.add(uid, 3, f"unit{uid}")
    batch, evicted = buf.take_batch(c)
    assert [f.uid for f in batch] == [0, 1] and not evicted
    c.step()
    c.version += 1  # pretend another step happened elsewhere: units 2 and 3 (v3) are now 2 behind
    c.accepted += 2
    batch, evicted = buf.take_batch(c)
    assert [f.uid for f in evicted] == [2, 3] and batch == [] and len(buf) == 0
    assert c.rejected == 2


def test_counters_and_errors():
    c = StalenessController(max_staleness=1, batch_size=2, version=5)
    assert c.capacity() == 4 and c.steps == 0
    assert c.launch(4) == 5
    with pytest.raises(StalenessError, match="capacity"):
        c.launch(1)
    assert c.finish(5) and c.finish(5)
    c.cancel()
    assert c.capacity() == 1 and c.running == 1
    assert c.step() == 6 and c.capacity() == 1 + 2
    with pytest.raises(StalenessError, match="newer"):
        c.finish(7)
    with pytest.raises(StalenessError, match="full batch"):
        c.step()
    m = c.metrics()
    assert m["async/version"] == 6 and m["async/accepted"] == 2 and m["async/cancelled"] == 1
    with pytest.raises(ValueError):
        StalenessController(max_staleness=-1, batch_size=1)
