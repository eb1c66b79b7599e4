"""Tree attention as varlen parts merged by log-sum-exp (treerl.tree_flash): exact
against a dense masked attention in float64, forward and backward, on random trees and
segments with prefix keys from earlier calls; on CUDA the flash kernels in bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treerl.attention import dense_tree_mask
from treerl.tree import PrefixTree
from treerl.tree_flash import flash_available, tree_flash_attention, tree_parts


def random_tree(rng: np.random.Generator, n_seqs: int = 7, vocab: int = 3) -> PrefixTree:
    seqs = []
    for _ in range(n_seqs):
        if seqs and rng.random() < 0.7:  # extend or branch off an earlier sequence
            base = seqs[rng.integers(len(seqs))]
            cut = int(rng.integers(1, len(base) + 1))
            seqs.append(np.concatenate([base[:cut], rng.integers(0, vocab, int(rng.integers(1, 9)))]))
        else:
            seqs.append(rng.integers(0, vocab, int(rng.integers(1, 12))))
    return PrefixTree.from_sequences(seqs)


def segment(tree: PrefixTree, a: int, b: int):
    """Queries [a, b); keys: the earlier tokens some query sees (prefix), then [a, b)."""
    idx, end = torch.arange(tree.num_tree_tokens), tree.subtree_end
    prefix = torch.nonzero((idx < a) & (end > a)).flatten()
    keys = torch.cat([prefix, idx[a:b]])
    return idx[a:b], keys, end[keys]


def dense_reference(q, k, v, qi, ki, ke, scale):
    rep = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) * scale
    s = s.masked_fill(~dense_tree_mask(qi, ki, ke)[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.repeat_interleave(rep, 1))


@pytest.mark.parametrize("seed", range(12))
def test_matches_dense_attention_float64(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng)
    n = tree.num_tree_tokens
    a = int(rng.integers(0, n))
    b = int(rng.integers(a + 1, n + 1))
    qi, ki, ke = segment(tree, a, b)
    H, Hkv, D = 4, 2, 8
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(qi), H, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(len(ki), Hkv, D, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(len(ki), Hkv, D, dtype=torch.float64, generator=g, requires_grad=True)
    dout = torch.randn(len(qi), H, D, dtype=torch.float64, generator=g)
    parts = tree_parts(qi, ki, ke)
    out = tree_flash_attention(q, k, v, parts, 0.3)
    ref = dense_reference(q, k, v, qi, ki, ke, 0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_levels_of_a_deep_tree():
    # a chain of branch points: each level's descendant ranges are disjoint
    seqs = [[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 5], [0, 6, 7], [8, 9]]
    tree = PrefixTree.from_sequences(seqs)
    n = tree.num_tree_tokens
    qi, ki, ke = segment(tree, 0, n)
    parts = tree_parts(qi, ki, ke)
    assert len(parts.levels) == 3
    for part in parts.levels:
        rows = part.q_rows.tolist()
        assert len(rows) == len(set(rows))


@pytest.mark.skipif(not torch.cuda.is_available() or not flash_available(torch.device("cuda"), torch.bfloat16),
                    reason="needs CUDA flash attention")
@pytest.mark.parametrize("seed", range(4))
def test_cuda_flash_kernels_bf16(seed):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 4, int(rng.integers(100, 400))) for _ in range(3)]
    seqs += [np.concatenate([seqs[i % 3][: int(rng.integers(50, 100))], rng.integers(0, 4, int(rng.integers(1, 300)))])
             for i in range(6)]
    tree = PrefixTree.from_sequences(seqs)
    n = tree.num_tree_tokens
    qi, ki, ke = segment(tree, n // 3, n)
    H, Hkv, D = 16, 8, 128
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda m, h: torch.randn(m, h, D, device="cuda", generator=g, dtype=torch.float64)  # noqa: E731
    q64, k64, v64, do64 = mk(len(qi), H), mk(len(ki), Hkv), mk(len(ki), Hkv), mk(len(qi), H)
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q64, k64, v64)]
    parts = tree_parts(qi.cuda(), ki.cuda(), ke.cuda())
    out = tree_flash_attention(*leaves, parts, D ** -0.5)
    grads = torch.autograd.grad(out, leaves, do64.to(torch.bfloat16))
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = dense_reference(*ref_leaves, qi.cuda(), ki.cuda(), ke.cuda(), D ** -0.5)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do64.to(torch.bfloat16).double())
    # bf16 kernels against float64 on the same bf16 inputs: bf16 rounding of the outputs
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, ref_grads):
        err = (got.double() - want).norm() / want.norm()
        assert err < 2e-2, float(err)
