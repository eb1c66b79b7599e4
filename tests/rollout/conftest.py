"""Fixtures of the rollout tests."""

from __future__ import annotations

import pytest

from treerl.rollout import log_reads


@pytest.fixture(params=[0, 2], ids=["reads-at-once", "reads-lagging"])
def read_lag(request, monkeypatch) -> int:
    """Reads of the decode log as on the CPU (complete at once) and as on CUDA, where a read
    completes only once the device has run the steps it logged, while the host is ahead: a
    read is ready only at its third poll, so rows finish late and rows that stopped decode
    past their stop meanwhile. A test that takes it must give the same outputs both ways."""
    if request.param:
        ready = log_reads.LogRead.ready

        def lagging(self) -> bool:
            self.polls = getattr(self, "polls", 0) + 1
            return self.polls > request.param and ready(self)

        monkeypatch.setattr(log_reads.LogRead, "ready", lagging)
    return request.param
