"""Planning by a memory budget, and decoder blocks recomputed in the backward.

Every mode under a budget small enough that calls recompute their blocks (and, for
``auto``/``dfs``, that trees split into chains) stays exact against the per-sequence
reference: float64 to 1e-9, float32 to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from conftest import VARIANTS, RandomLoss, get_model, shaped_forest
from test_engine_exact import MODES, SPEC, check_engine
from treerl import PrefixTree, TreeEngine
from treerl.memory import MemoryModel, resolve_budget


def budget_for(model, full_tokens: int) -> int:
    """A budget in which a call of ``full_tokens`` tokens just fits without recompute."""
    m = MemoryModel.estimate(model.config, next(model.parameters()).dtype, dense_mask=True)
    return int(m.fixed + full_tokens * m.per_token + full_tokens**2 * m.per_pair) + 1


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_recomputed_blocks_are_exact(mode, variant, dtype, gen):
    seqs = shaped_forest(gen, SPEC)
    # 16 layers: recomputing blocks holds ~8x fewer bytes per token than not
    model = get_model(variant, dtype, num_hidden_layers=16)
    budget = budget_for(model, 6)  # calls over 6 tokens recompute their blocks
    chunk = 12 if mode == "dfs" else 4  # dfs batches up to chunk_tokens: calls over 6 tokens
    engine = TreeEngine(model, mode, memory_budget=budget, chunk_tokens=chunk)
    assert engine.recomputes(7) and not engine.recomputes(6)
    assert engine.max_tokens >= 39  # every tree (and sequence) fits one call with recompute
    loss = RandomLoss.make(seqs, gen, coupled=True, one_sign=dtype == torch.float32)
    engine = check_engine(model, seqs, mode, loss, entropy=True, chunk_tokens=chunk, memory_budget=budget)
    assert engine.stats.recomputed_calls >= 1, engine.stats


@pytest.mark.parametrize("separable", [False, True])
@pytest.mark.parametrize("keep_all", [False, True], ids=["", "every-attention-kept"])
def test_budget_splits_trees_with_recomputed_chains(separable, keep_all, gen, monkeypatch):
    """With ``keep_all`` every recomputed call keeps every layer's attention, whatever the
    budget: chained calls attend over their prefix (concatenated K/V) exactly too."""
    if keep_all:
        monkeypatch.setattr(TreeEngine, "kept_attention_layers",
                            lambda self, queries, keys, copies: frozenset(range(self.num_layers)))
    seqs = shaped_forest(gen, SPEC)
    tree = PrefixTree.from_sequences(seqs)
    model = get_model("qwen3", num_hidden_layers=16)
    m = MemoryModel.estimate(model.config, torch.float64, dense_mask=True)
    # with recompute, calls of up to 13 tokens fit (the 39-token tree splits into chains);
    # without, only ~2 (so every call over that recomputes)
    budget = int(m.fixed + 13 * m.recompute_per_token + 13**2 * m.per_pair) + 1
    engine = TreeEngine(model, "auto", memory_budget=budget, chunk_tokens=4)
    assert engine.max_tokens == 13 and engine.recomputes(4)
    plan = engine.plan(tree)
    assert any(plan.children) and max(s.size for s in plan.segments) <= 13
    loss = RandomLoss.make(seqs, gen)
    engine = check_engine(model, seqs, "auto", loss, chunk_tokens=4, memory_budget=budget, separable=separable)
    assert engine.stats.recomputed_calls >= 1
    if keep_all:
        assert engine.stats.kept_attention_layers == 16 * engine.stats.recomputed_calls


@pytest.mark.parametrize("mode", ["auto", "flat"])
def test_recomputed_blocks_keep_attention_within_the_budget(mode, gen, monkeypatch):
    """Room in the budget beside a recomputed call goes to keeping the attention of its
    last layers: their recompute in the backward skips the attention, and their
    attention's backward reads the recomputed query/key/value, exactly."""
    import treerl.attention as attention

    seqs = shaped_forest(gen, SPEC)
    model = get_model("qwen3", torch.float64, num_hidden_layers=16)
    m = MemoryModel.estimate(model.config, torch.float64, dense_mask=True)
    largest = 39  # shaped_forest(SPEC)'s largest tree: one call with recompute
    held = m.fixed + largest * m.recompute_per_token + largest**2 * m.per_pair
    per_layer = (largest * (m.attention_per_query + m.attention_copies_per_query + m.attention_copies_per_key)
                 + largest**2 * m.attention_per_pair)  # SDPA's inputs are copies
    budget = int(held + 5.5 * per_layer)  # 5 of 16 layers keep their attention in a 39-token call
    assert m.kept_attention_layers(budget, largest, largest, 16, copies=True) == 5
    engine = TreeEngine(model, mode, memory_budget=budget, chunk_tokens=4)
    assert engine.kept_attention_layers(largest, largest, copies=True) == frozenset(range(11, 16))  # SDPA
    assert engine.recomputes(largest) and engine.max_tokens >= largest
    attends = {}  # per call (its TreeAttention, held): layers kept, attention runs
    attend = attention._attend

    def spy(ctx, *args, **kwargs):
        attends[ctx] = (len(ctx.keep_layers), attends.get(ctx, (0, 0))[1] + 1)
        return attend(ctx, *args, **kwargs)

    monkeypatch.setattr(attention, "_attend", spy)
    loss = RandomLoss.make(seqs, gen, coupled=True)
    engine = check_engine(model, seqs, mode, loss, entropy=True, chunk_tokens=4, memory_budget=budget)
    assert 5 <= engine.stats.kept_attention_layers <= 16 * engine.stats.recomputed_calls, engine.stats
    if mode == "auto":  # the 39-token tree's call keeps 5; flat packs its sequences into calls that keep all 16
        assert 5 in {k for k, _ in attends.values()}
    # a recomputed call's layers attend in the forward, and again in the backward unless kept
    assert any(k for k, _ in attends.values())
    assert all(runs == 32 - k for k, runs in attends.values() if k), attends
    # and their backward read q/k/v from the recompute, not from held tensors
    assert all(k.views_saved > 0 for ctx in attends for k in ctx.kept.values())


def test_memory_model_tokens():
    m = MemoryModel(fixed=100.0, per_token=10.0, recompute_per_token=2.0)
    assert m.tokens(1100, recompute=False) == 100
    assert m.tokens(1100, recompute=True) == 500
    assert m.tokens(50, recompute=False) == 1  # never below one token
    q = MemoryModel(fixed=0.0, per_token=10.0, recompute_per_token=2.0, per_pair=1.0)
    n = q.tokens(10_000, recompute=False)
    assert n * 10 + n * n <= 10_000 < (n + 1) * 10 + (n + 1) ** 2


def test_estimate_grows_with_the_model_and_recompute_is_cheaper():
    small = MemoryModel.estimate(get_model("qwen3").config, torch.float32)
    assert small.recompute_per_token < small.per_token
    bigger = get_model("qwen3", num_hidden_layers=4).config
    assert MemoryModel.estimate(bigger, torch.float32).per_token > small.per_token


@pytest.mark.parametrize("bad", [0, -5, 1.5, 4096, float("nan"), "8GB", True])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        resolve_budget(bad, torch.device("cpu"))


def test_budget_forms():
    cpu = torch.device("cpu")
    assert resolve_budget(8 << 30, cpu) == 8 << 30
    assert resolve_budget(float(8 << 30), cpu) == 8 << 30  # YAML/CLI floats: bytes above 1
    assert resolve_budget(0.5, cpu) > resolve_budget(0.1, cpu) > 0
    assert resolve_budget(None, cpu) == resolve_budget(0.2, cpu)
    model = get_model("qwen3")
    assert TreeEngine(model, max_tokens=77).max_tokens == 77  # the override: no budget
    assert not TreeEngine(model, max_tokens=77).recomputes(10**6)


def test_single_chain_segments_run_plain_causal_attention(gen, monkeypatch):
    """A segment that is one chain without prefix (flat's long sequences, a lone path)
    runs SDPA's causal kernel with no mask tensor, exactly."""
    import treerl.attention as attention

    seen = []
    sdpa = attention.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("is_causal", False), kwargs.get("attn_mask") is None))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    model = get_model("qwen3")
    seqs = [[1] + torch.randint(2, 60, (20,), generator=gen).tolist(), [2, 3, 4, 5], [6, 7, 8]]
    loss = RandomLoss.make(seqs, gen)
    check_engine(model, seqs, "flat", loss, max_tokens=21)  # the long sequence alone, the two short ones packed
    assert (True, True) in seen and (False, False) in seen  # causal calls, and masked ones



def test_separable_mixed_plan_runs_whole_trees_once(gen):
    """A plan where one tree splits into chains and the others fit a call: with a separable
    loss the fitting trees run forward+backward once (no two-phase extra forward), exactly."""
    seqs = shaped_forest(gen, SPEC)  # trees of 39, 5 and 17 tokens
    model = get_model("qwen3")
    plan = TreeEngine(model, "auto", max_tokens=20, chunk_tokens=4).plan(seqs)
    standalone = [s for i, s in enumerate(plan.segments) if s.parent < 0 and not plan.children[i]]
    assert standalone and any(plan.children)
    runs = {}
    for separable in (False, True):
        loss = RandomLoss.make(seqs, gen)
        engine = check_engine(model, seqs, "auto", loss, max_tokens=20, chunk_tokens=4, separable=separable)
        runs[separable] = engine.stats.tokens_run
    assert runs[False] - runs[True] == sum(s.size for s in standalone)
