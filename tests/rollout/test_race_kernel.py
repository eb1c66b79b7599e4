"""The one-pass sampling race (:mod:`treerl.rollout.race_kernel`) against the torch reference
(:func:`~treerl.rollout.sampling.race_reference`): the same tokens, the same logprobs to
float32 accuracy. On a GPU, or on the CPU with ``TRITON_INTERPRET=1`` (every CI run takes it
that way through ``tests/rollout/test_kernels_interpreted.py``); the whole-vocabulary cases and
the draws' distribution are ``tests/cuda/test_rollout_cuda.py``'s."""

from __future__ import annotations

import os

import pytest
import torch

from treerl.rollout import race_kernel
from treerl.rollout.sampling import draw_seeds, race_reference

pytestmark = pytest.mark.skipif(
    race_kernel.triton is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, device=DEVICE) * 4
    x[0, vocab - 1] = 30.0  # a peak in the last, partial block
    if rows > 2:
        x[2, : vocab // 2] = float("-inf")  # a row whose first half is masked out
    return x.to(dtype)


@pytest.mark.parametrize("rows, vocab, splits", [(5, 5000, None), (5, 5000, 1), (3, 2048, 2), (4, 700, None),
                                                 (6, 4097, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_race_kernel_matches_the_reference(rows, vocab, splits, dtype):
    logits = _logits(rows, vocab, dtype, seed=vocab + rows)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.0], device=DEVICE)[:rows]
    seeds = draw_seeds(rows, torch.Generator(device=DEVICE).manual_seed(1), logits.device)
    for t in (temperature, torch.ones(1, device=DEVICE)):
        want_tok, want_lp = race_reference(logits, t, seeds)
        tok, lp = race_kernel.race_kernel(logits, t, seeds, splits=splits)
        assert torch.equal(tok, want_tok), (tok, want_tok)
        assert torch.allclose(lp, want_lp.float(), rtol=1e-5, atol=1e-5), (lp - want_lp).abs().max()


def test_race_kernel_breaks_ties_at_the_first_column():
    """Greedy rows of equal logits take the first column, as ``argmax`` does: within a lane, across lanes, and
    across split ranges."""
    rows, vocab = 3, 6000
    logits = torch.zeros(rows, vocab, device=DEVICE)
    logits[1, [4100, 4101, 5000]] = 2.0  # ties in later blocks, in one lane and across lanes
    logits[2, [2049, 1]] = 5.0  # column 1 wins over a later block's lane 1
    t = torch.zeros(1, device=DEVICE)
    seeds = draw_seeds(rows, None, logits.device)
    for splits in (1, 2, 3):
        tok, lp = race_kernel.race_kernel(logits, t, seeds, splits=splits)
        assert tok.tolist() == [0, 4100, 1], (splits, tok)
        assert torch.allclose(lp, race_reference(logits, t, seeds)[1], atol=1e-6)
