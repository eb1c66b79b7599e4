"""The loss head's chunk forward kernel (Triton, :mod:`treerl.engine.head_kernel`) against float64:
log-sum-exp, the target's log-probability and the entropy, rows longer and shorter than the kernel's
block, any temperature. On a GPU, or on the CPU with ``TRITON_INTERPRET=1`` (every CI run takes it
that way through ``tests/rollout/test_kernels_interpreted.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from treerl.engine import head_kernel
from treerl.engine.loss_head import _chunk_forward


def _runs() -> bool:
    return head_kernel.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def _dtypes():
    return [torch.bfloat16, torch.float16, torch.float32] if torch.cuda.is_available() else [torch.float32, torch.float16]


pytestmark = pytest.mark.skipif(not _runs(), reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")


@pytest.mark.parametrize("vocab, block", [(1000, 256), (512, 256), (300, 512), (151936, 4096)])
@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("entropy", [False, True])
def test_chunk_forward_matches_float64(vocab, block, dtype, entropy):
    """No further from float64 than the float32 torch path it replaces (x3, + 2e-6: a bias of 1e-5 fails)."""
    if vocab > 10_000 and not torch.cuda.is_available():
        pytest.skip("a whole Qwen vocabulary: on a GPU (the interpreter takes minutes)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(vocab)
    rows, inv_temperature = 5, 1 / 0.7
    raw = (torch.randn(rows, vocab, generator=gen, device=device) * 4).to(dtype)
    raw[1, 7] = 40.0  # one row nearly one-hot (its exponentials underflow but one)
    targets = torch.randint(0, vocab, (rows,), generator=gen, device=device)
    targets[0], targets[1] = vocab - 1, 7  # the last column (inside the last, partial block), the peak
    got = head_kernel.chunk_forward(raw, targets, inv_temperature, entropy, block=block, warps=4)
    ref = _chunk_forward(raw.double(), targets, inv_temperature, True)
    torch32 = _chunk_forward(raw.float(), targets, inv_temperature, True)
    assert all(x.dtype == torch.float32 and x.shape == (rows,) for x in got[:2])
    assert (got[2] is not None) == entropy
    for name, g, r, t in zip(("lse", "logprob", "entropy"), got, ref, torch32):
        if g is None:
            continue
        err, err32 = (g.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
        assert err <= 3 * err32 + 2e-6, (name, err, err32)


def test_no_rows_and_a_non_contiguous_chunk():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lse, lp, ent = head_kernel.chunk_forward(torch.zeros(0, 64, device=device), torch.zeros(0, dtype=torch.long,
                                             device=device), 1.0, True)
    assert lse.shape == lp.shape == ent.shape == (0,)
    raw = torch.randn(64, 6, device=device).t()  # [6, 64] with columns strided
    targets = torch.arange(6, device=device)
    got = head_kernel.chunk_forward(raw, targets, 1.0, False, block=32, warps=1)
    ref = _chunk_forward(raw.double(), targets, 1.0, False)
    assert torch.allclose(got[0].double(), ref[0], atol=1e-5) and torch.allclose(got[1].double(), ref[1], atol=1e-5)
