"""Small uploads through the pinned staging ring (``treerl.rollout.types.to_device`` on CUDA):
values, dtypes and shapes arrive as sent, also when the ring wraps while earlier copies are
still queued behind device work (a slot is written again only after its copy ran), and
arrays too large for a slot or empty go the plain pinned way. Skipped without a GPU."""

import numpy as np
import pytest
import torch

from treerl.rollout.types import PinnedStaging, to_device

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_uploads_arrive_as_sent_when_the_ring_wraps_behind_queued_work():
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    ring = PinnedStaging.of(dev)
    torch.cuda._sleep(200_000_000)  # device work queued ahead of every copy below (~0.1 s)
    sent, got = [], []
    for i in range(3 * len(ring.events) + 5):  # wraps the ring three times while the first copies wait
        kind = i % 4
        if kind == 0:
            a = rng.integers(-2**40, 2**40, size=(int(rng.integers(1, 300)),), dtype=np.int64)
        elif kind == 1:
            a = rng.random((3, int(rng.integers(1, 50)))).astype(np.float64)
        elif kind == 2:
            a = rng.random(int(rng.integers(1, 40))) > 0.5
        else:
            a = rng.integers(0, 100, size=(int(rng.integers(0, 4)), 2)).astype(np.int32)  # (may be empty)
        sent.append(a.copy())
        got.append(to_device(a, dev))
        a[...] = 0 if a.dtype != bool else False  # the caller may reuse its array at once
    big = rng.random(5000)  # 40 KB: more than a slot
    got.append(to_device(big, dev))
    sent.append(big)
    torch.cuda.synchronize()
    for a, t in zip(sent, got):
        assert t.device.type == "cuda" and t.dtype == torch.as_tensor(a).dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.cpu().numpy(), a)
