"""A prefill window's attention through the split-key kernel (treerl.rollout.window_attention):
against float64 attention under the prefill's dense mask (rows of different lengths, padding
queries and rows, several query blocks and key ranges), and a model's prefills through it
equal to its SDPA prefills. Runs under Triton's interpreter (TRITON_INTERPRET=1) on the CPU
and on a CUDA GPU; skipped elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")
triton = pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _prefill_mask(first: list[int], new: list[int], T: int, L: int, dtype: torch.dtype) -> torch.Tensor:
    """The prefill's additive mask [B, 1, T, L] (Prefiller.mask): query slot q of row i sees
    [first_i, q] when it is one of the row's new tokens (q >= new_i), else slot 0 only."""
    from treerl.rollout.prefill import prefill_mask

    pad = torch.arange(L - T, L, device=DEV)[None, :] < torch.tensor(new, device=DEV)[:, None]
    return prefill_mask(torch.tensor(first, device=DEV)[:, None], pad, L - T, L, dtype)[0]


@pytest.mark.parametrize("T, L, Hq, H, target", [
    (16, 90, 4, 2, 528),  # a small window: one query block of G x T = 32
    (40, 230, 4, 2, 528),  # several query blocks (80 queries a KV head), several key ranges
    (64, 300, 2, 1, 8),  # few programs: one key range a block
    (24, 24, 2, 2, 528),  # no cached prefix: the window is the whole cache
    (16, 700, 4, 2, None),  # the default target: ranges past rows' first slots' reach empty (LSE -inf, none read)
    (128, 600, 2, 2, None),  # query blocks of 64 of one head's 128: the first's causal bound leaves the last range empty
    (1, 300, 4, 2, 8),  # one query a row, one key range (no merge)
    (1, 300, 4, 2, 528),  # one query a row, several key ranges (merged)
])
def test_window_attention_equals_float64_under_the_prefill_mask(T, L, Hq, H, target):
    """Every real query's output equals float64 attention under the dense mask; padding
    queries' outputs (never used) are finite."""
    from treerl.rollout.window_attention import window_attention

    g = torch.Generator(device=DEV).manual_seed(T + L)
    D = 16
    # rows: the whole window new over a long prefix; a short row with padding queries; a padding row; a row whose
    # window holds only cached tokens (a full hit: every query padding)
    first, new = [1, L - min(L, T + 7) + 1, L, max(1, L - T - 3)], [max(1, L - T), L - 5, L, L]
    B = len(first)
    q = torch.randn(B, Hq, T, D, device=DEV, generator=g)
    k = torch.randn(B, H, L, D, device=DEV, generator=g)
    v = torch.randn(B, H, L, D, device=DEV, generator=g)
    mask = _prefill_mask(first, new, T, L, torch.float32)
    got = window_attention(q, k, v, mask, D ** -0.5, **({} if target is None else {"target": target}))
    assert got.shape == (B, T, Hq, D) and torch.isfinite(got).all()
    assert got._base is None and got.is_contiguous()  # its own tensor whatever the branch (the compiled tail's guards)
    s = q.double() @ k.double().repeat_interleave(Hq // H, 1).transpose(-1, -2) * D ** -0.5 + mask.double()
    ref = (torch.softmax(s, -1) @ v.double().repeat_interleave(Hq // H, 1)).transpose(1, 2)  # [B, T, Hq, D]
    for i in range(B):
        real = slice(max(0, new[i] - (L - T)), T)
        assert torch.allclose(got[i, real].double(), ref[i, real], atol=1e-5), (i, (got[i, real] - ref[i, real]).abs().max())


def test_window_attention_in_bfloat16_on_a_gpu():
    """bf16 (the GPU's serving dtype; the interpreter's bf16 products are not bf16 math)."""
    if not torch.cuda.is_available():
        pytest.skip("bf16 kernels need a GPU")
    from treerl.rollout.window_attention import window_attention, window_attention_ok

    assert window_attention_ok(DEV, torch.bfloat16, 128, 128)
    g = torch.Generator(device=DEV).manual_seed(0)
    T, L, Hq, H, D = 128, 2048, 16, 8, 128
    first, new = [1, 900, L], [L - T, L - 77, L]
    q, k, v = (torch.randn(3, h, n, D, device=DEV, generator=g).bfloat16() for h, n in ((Hq, T), (H, L), (H, L)))
    mask = _prefill_mask(first, new, T, L, torch.bfloat16)
    got = window_attention(q, k, v, mask, D ** -0.5).float()
    s = q.float() @ k.float().repeat_interleave(2, 1).transpose(-1, -2) * D ** -0.5 + mask.float()
    ref = (torch.softmax(s, -1) @ v.float().repeat_interleave(2, 1)).transpose(1, 2)
    for i in range(2):  # (row 2: a padding row, no real query)
        real = slice(max(0, new[i] - (L - T)), T)
        assert (got[i, real] - ref[i, real]).abs().max() < 2e-2


@pytest.mark.parametrize("graph_tokens", [0, 512], ids=["chunked", "buckets"])
def test_model_prefills_through_the_window_kernel_equal_its_sdpa_prefills(graph_tokens, monkeypatch):
    """An agent's three turns (later turns from the prefix cache: a cached context, a few new
    tokens) and a batch of fresh prompts: greedy outputs equal and logprobs within float32
    rounding of the same engine with SDPA prefills; chunked (a prefill of several forwards)
    and in fixed buckets."""
    import treerl.rollout.prefill_blocks as pb
    from helpers.models import tiny_model
    from helpers.rollout import random_prompts, sampling
    from treerl.rollout import RolloutEngine

    model = tiny_model(dtype=torch.float32, randomise=1).to(DEV)
    runs = []
    for window in (False, True):
        monkeypatch.setattr(pb, "window_kernel_ok", lambda decode, window=window: window)
        engine = RolloutEngine(model, sync_every=2, prefix_cache_tokens=4000, prefill_chunk_tokens=64,
                               prefill_graph_tokens=graph_tokens, static_kv=True, kv_block_size=16, cuda_graphs=False)
        assert engine.prefiller.forward.window is window
        out, prompt, hits = [], random_prompts([37], seed=1)[0], 0
        for turn in range(3):
            [[c]] = engine.generate_stream([prompt], sampling(12, n=1))
            out.append(c)
            hits += engine.stats.prefix_cache_hit_tokens
            prompt = prompt + c.completion_ids.tolist() + [3 + turn, 9]
        assert hits > 37  # later turns: their earlier turns from the cache
        out += [c for group in engine.generate_stream(random_prompts([5, 29, 50], seed=2), sampling(12, n=2))
                for c in group]
        runs.append(out)
    for a, b in zip(*runs):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4), (a.logprobs - b.logprobs).abs().max()
