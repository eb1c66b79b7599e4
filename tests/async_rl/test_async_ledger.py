"""The work ledger: results of superseded attempts are refused, a failed worker's units
come back, nothing is trained twice or lost, and the state survives a checkpoint."""

import pytest

from treerl.async_rl import LedgerError, WorkLedger
from treerl.async_rl.runner import batch_samples
from treerl.trainer import Sample


def test_attempts_failures_and_exactly_once():
    led = WorkLedger()
    a, b = led.new_unit(["p0"], 4), led.new_unit(["p1"], 4)
    led.launch(a, worker=0, min_version=3)
    led.launch(b, worker=1, min_version=3)
    assert a.attempt == 1 and a.min_version == 3
    lost = led.fail_worker(0)
    assert lost == [a] and led.in_flight_on(0) == []
    led.requeue(a)
    assert led.complete(a.uid, 1, worker=0) is None  # the dead incarnation's result
    unit = led.queued.popleft()
    led.launch(unit, worker=1, min_version=4)
    assert led.complete(a.uid, 1, worker=1) is None  # old attempt number
    assert led.complete(a.uid, 2, worker=1) is a
    led.buffer(a)
    assert led.complete(b.uid, 1, worker=1) is b
    led.buffer(b)
    led.check()
    led.mark_trained([a.uid, b.uid])
    with pytest.raises(LedgerError, match="twice"):
        led.mark_trained([a.uid])
    with pytest.raises(LedgerError, match="trained already"):
        led.requeue(a)
    assert led.stale_results == 2 and led.requeues == 1
    led.check()


def test_check_finds_lost_units_and_state_round_trips():
    led = WorkLedger()
    units = [led.new_unit([f"p{i}"], 2, rng_state=bytes([i])) for i in range(4)]
    led.launch(units[0], 0, 0)
    led.queued.extend(units[1:3])
    with pytest.raises(LedgerError, match="lost"):
        led.check()  # unit 3 is nowhere
    led.queued.append(units[3])
    led.check()
    back = WorkLedger.from_state(led.state_dict())
    assert back.next_uid == 4 and [u.uid for u in back.queued] == [0, 1, 2, 3]
    assert back.queued[1].problems == ["p1"] and back.queued[2].rng_state == bytes([2])
    back.check()


def test_batch_samples_renumbers_groups_and_episodes_per_unit():
    def s(group, episode):
        return Sample([1, 2], [True], [0.0], [0], 0.0, group, episode)

    out = batch_samples([[s(0, 0), s(0, 1), s(1, 2)], [s(0, 0), s(0, 1)]])
    assert [(x.group, x.episode) for x in out] == [(0, 0), (0, 1), (1, 2), (2, 3), (2, 4)]
