"""The flex block mask is built analytically from the tree (never N x N): check it
against the dense tree mask on random segments, with and without ancestor prefixes."""

import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import treerl
from treerl.engine.attention import FLEX_BLOCK, _flex_whole_tiles, dense_tree_mask, flex_block_mask
from treerl.devtools.workloads import SCALES, make_workload


def ancestors(tree, token):
    out, p = [], int(tree.parent[token])
    while p >= 0:
        out.append(p)
        p = int(tree.parent[p])
    return out[::-1]


@pytest.mark.parametrize("workload", ["grpo", "agentic", "none"])
@pytest.mark.parametrize("block", [4, 16, FLEX_BLOCK])
def test_block_mask_matches_dense(workload, block):
    seed = zlib.crc32(f"{workload}-{block}".encode())
    gen = torch.Generator().manual_seed(seed)
    tree = treerl.PrefixTree.from_sequences(make_workload(workload, SCALES["small"], 300, seed=seed % 1000))
    n = tree.num_tree_tokens
    for _ in range(6):
        a = int(torch.randint(0, n - 1, (1,), generator=gen))
        b = int(torch.randint(a + 1, n + 1, (1,), generator=gen))
        q = torch.arange(a, b)
        k = torch.cat([torch.tensor(ancestors(tree, a), dtype=torch.long), q])
        k_end = tree.subtree_end[k]
        mask = flex_block_mask(q, k, k_end, block=block)
        dense = dense_tree_mask(q, k, k_end)
        nq, nk = -(-len(q) // block), -(-len(k) // block)
        padded = torch.zeros(nq * block, nk * block, dtype=torch.bool)
        padded[: len(q), : len(k)] = dense
        tiles = padded.view(nq, block, nk, block)
        # Every tile with a visible pair is listed (partial or full), no other tile is.
        listed = mask.to_dense()[0, 0].bool()
        assert torch.equal(listed, tiles.any(3).any(1))
        # Tiles marked full skip the mask function: every pair in them must be visible.
        full = torch.zeros(nq, nk, dtype=torch.bool)
        counts, idx = mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]
        for row in range(nq):
            full[row, idx[row, : counts[row]].long()] = True
        assert full.any() or len(q) < 2 * block or block == FLEX_BLOCK  # small trees: few whole tiles
        assert tiles.all(3).all(1)[full].all()
        # Elementwise: flex (eager, CPU) with this mask, on the sequences padded to whole
        # tiles as the engine runs it, equals SDPA with the dense mask.
        qq, kk, vv = (torch.randn(1, 2, m, 8, generator=gen) for m in (len(q), len(k), len(k)))
        pad = [F.pad(x, (0, 0, 0, -x.shape[2] % block)) for x in (qq, kk, vv)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if block == FLEX_BLOCK:  # the engine's tile view
                tiles = [x.unflatten(2, (-1, block)) for x in pad]
                out = _flex_whole_tiles(*tiles, mask, None, False)[:, :, : len(q)]
            else:
                out = flex_attention(*pad, block_mask=mask)[:, :, : len(q)]
        ref = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=dense[None, None])
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
