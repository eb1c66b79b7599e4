"""A group of leaves after a prefix (treerl.engine.group_attention): the prefix's full attention
through a fused kernel merged by log-sum-exp with the own keys' tree-masked attention, and the
backward through both (the fused part's from the merged output, the own part's by autograd
through its log-sum-exp).

float64 on the CPU against autograd through a dense masked softmax over all keys (1e-9
relative), also with the kernel calls on a grid (dummy rows after the queries, prefix keys
moved to the own part, as cuDNN's run) and in the kernels' log-sum-exp formats; flex's own
part (eager forward on the CPU: its backward runs on CUDA, tests/cuda) against the math's; the
engine end to end against the per-sequence reference with the path on (counted by the
engine's attention routes), with kept attentions, and the routes of a long prompt's groups.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import treerl.engine.attention as attention
import treerl.engine.chain_attention as chain
import treerl.engine.group_attention as group
from helpers.attention import assert_rel, dense_reference, inputs, recording
from helpers.engine import check_engine
from helpers.forests import RandomLoss, random_seq, shaped_forest
from helpers.models import get_model
from treerl import PrefixTree, TreeEngine
from treerl.engine.memory import MemoryPolicy

# responses after a prompt: branches inside the group (a small tree), a 1-token node, a strict prefix
GROUP_SPEC = [(3, [(2, []), (4, [])]), (5, []), (1, [(1, []), (2, [])], True), (2, [])]  # 20 tokens


def group_tree(gen, prefix: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_index, k_index, k_end of a group of responses after a ``prefix``-token prompt."""
    tree = PrefixTree.from_sequences(shaped_forest(gen, [(prefix, GROUP_SPEC)]))
    n = tree.num_tree_tokens
    k_index = torch.arange(n)
    return k_index[prefix:], k_index, tree.subtree_end[k_index]


def lse_as(layout: str, align: int) -> chain.Kernel:
    """MATH with its log-sum-exp in another kernel's format (cuDNN's [B, H, N, 1], the
    memory-efficient kernel's [B, H, N rounded up to 32] with junk in the padding)."""

    def forward(q, k, v, causal, scale):
        out, lse, extra = chain._math_forward(q, k, v, causal, scale)
        if layout == "column":
            return out, lse[..., None], extra
        padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), float("nan"), dtype=lse.dtype)
        padded[..., :lse.shape[2]] = lse
        return out, padded, extra

    return chain.Kernel(f"math-{layout}", forward, chain._math_backward, align=align)


def run_group(gen, kernel, heads, kv_heads, prefix, dim=8, sharp=1.0):
    """The group attention of random inputs and its gradients, and the dense reference's."""
    q_index, k_index, k_end = group_tree(gen, prefix)
    ctx = attention.TreeAttention("sdpa", q_index, k_index, k_end)  # (its own masks only)
    q, k, v = inputs(gen, heads, kv_heads, len(q_index), len(k_index), dim)
    q = (sharp * q).detach().requires_grad_()
    scale = float(torch.rand((), generator=gen, dtype=torch.float64)) + 0.2
    grad = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    out = group.group_attention(q, k, v, scale, functools.partial(attention._own, ctx), kernel)
    ref = dense_reference(q, k, v, attention.dense_tree_mask(q_index, k_index, k_end), scale)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    return (out, *got), (ref, *want)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("prefix", [1, 2, 45])
@pytest.mark.parametrize("sharp", [1.0, 3.0])  # 3: sharper softmax, parts of very different weight
def test_merge_and_backward_match_dense_attention(heads, kv_heads, prefix, sharp, gen):
    dim = int(torch.randint(2, 9, (1,), generator=gen)) * 4
    got, want = run_group(gen, chain.MATH, heads, kv_heads, prefix, dim, sharp)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert_rel(a, b)


@pytest.mark.parametrize("align", [4, 16])
@pytest.mark.parametrize("prefix", [1, 3, 16, 21, 45, 75, 300])
@pytest.mark.parametrize("expand_kv", [False, True])
def test_lengths_on_a_grid_are_exact(align, prefix, expand_kv, gen):
    """An aligned kernel runs the full part on ``prefix - prefix % align`` keys and the queries
    with dummy rows after them up to a multiple of ``align``; the other prefix keys join the
    own part. Exact; a prefix shorter than the grid leaves no full part: None (the caller masks)."""
    calls = []
    kernel = recording(chain.Kernel("math", chain._math_forward, chain._math_backward, expand_kv, align), calls)
    if prefix < align:
        q_index, k_index, k_end = group_tree(gen, prefix)
        q, k, v = inputs(gen, 4, 2, len(q_index), len(k_index), 8)
        assert group.group_attention(q, k, v, None, lambda *a: pytest.fail("own part ran"), kernel) is None
        assert calls == []
        return
    got, want = run_group(gen, kernel, 4, 2, prefix, sharp=2.0)
    for a, b in zip(got, want):
        assert_rel(a, b)
    n = got[0].shape[2]
    rows, keys = -(-n // align) * align, prefix - prefix % align
    assert calls == [(rows, keys, False)] * 2, calls  # forward and backward: the full part only


@pytest.mark.parametrize("layout", ["column", "padded"])
def test_kernel_lse_formats(layout, gen):
    for align in (1, 8):
        got, want = run_group(gen, lse_as(layout, align), 4, 2, 33)
        for a, b in zip(got, want):
            assert_rel(a, b)


@pytest.mark.parametrize("prefix,first", [(45, 45), (45, 40), (130, 128), (256, 256)])
def test_flex_own_part_matches_the_math(prefix, first, gen, monkeypatch):
    """The own part through flex (eager forward on the CPU; its backward on CUDA: tests/cuda)
    returns the output and natural log-sum-exp of the math's, on whole tiles or not."""
    monkeypatch.setattr(attention, "_FLEX_TILES", attention._flex_whole_tiles)  # eager flex: no CPU compile
    monkeypatch.setattr(attention, "_FLEX_ANY", attention._flex_any)
    spec = [(prefix, GROUP_SPEC if prefix % 128 else [(128 - 20, GROUP_SPEC)])]  # 256: 128 queries, whole tiles
    tree = PrefixTree.from_sequences(shaped_forest(gen, spec))
    k_index = torch.arange(tree.num_tree_tokens)
    q_index, k_end = k_index[prefix:], tree.subtree_end
    q, k, v = (x.detach() for x in inputs(gen, 4, 2, len(q_index), len(k_index), 16))
    flex_ctx, math_ctx = (attention.TreeAttention(b, q_index, k_index, k_end) for b in ("flex", "sdpa"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is not compiled
        k_own, v_own = k[:, :, first:], v[:, :, first:]
        out, lse = attention._own(flex_ctx, q, k_own, v_own, first, 0.3)
    ref_out, ref_lse = attention._own(math_ctx, q, k_own, v_own, first, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_prefix_not_seen_by_all_is_no_group(monkeypatch):
    """A prefix key some query does not see (never in an engine plan: its prefixes are
    ancestors) keeps the call on the tree mask."""
    monkeypatch.setattr(attention, "GROUPS_AFTER_PREFIX", True)
    kv = [[(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))]]
    q_index, k_index = torch.arange(3, 6), torch.arange(6)
    seen = torch.tensor([6, 6, 6, 6, 6, 6])
    assert attention.TreeAttention("sdpa", q_index, k_index, seen, prefix=kv).group
    for hidden in ([6, 5, 6, 6, 6, 6], [6, 6, 3, 6, 6, 6]):  # key 1 unseen by query 5; key 2 by all
        assert not attention.TreeAttention("sdpa", q_index, k_index, torch.tensor(hidden), prefix=kv).group
    assert not attention.TreeAttention("sdpa", q_index, k_index, seen, prefix=kv, causal=True).group  # a chain
    monkeypatch.setattr(attention, "GROUPS_AFTER_PREFIX", False)
    assert not attention.TreeAttention("sdpa", q_index, k_index, seen, prefix=kv).group


def test_defaults_run_the_paths_after_a_prefix_on_cuda_only():
    """Both switches default to "cuda": on for CUDA tensors (where the fused kernels run), off on
    the CPU (the tree mask, unless a test turns them on); True and False mean on and off."""
    assert attention.CHAIN_AFTER_PREFIX == "cuda" and attention.GROUPS_AFTER_PREFIX == "cuda"
    cpu, cuda, meta = torch.device("cpu"), torch.device("cuda"), torch.device("meta")
    assert attention.path_on("cuda", cuda) and not attention.path_on("cuda", cpu) and not attention.path_on("cuda", meta)
    assert attention.path_on(True, cpu) and not attention.path_on(False, cuda)
    kv = [[(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))]]
    q_index, k_index, seen = torch.arange(3, 6), torch.arange(6), torch.full((6,), 6)
    assert not attention.TreeAttention("flex", q_index, k_index, seen, prefix=kv).group
    assert not attention.TreeAttention("flex", q_index, k_index, seen, prefix=kv, causal=True).causal


# ------------------------------------------------------------------ the engine
def count_group_calls(monkeypatch) -> list[int]:
    """Query counts of the group attentions run (forward), with the path switched on."""
    monkeypatch.setattr(attention, "GROUPS_AFTER_PREFIX", True)
    sizes = []
    apply = group.GroupMerge.apply
    monkeypatch.setattr(group.GroupMerge, "apply", lambda q, *rest: sizes.append(q.shape[2]) or apply(q, *rest))
    return sizes


def responses_after_prompt(gen, prompt: int, count: int = 6) -> list[list[int]]:
    """A prompt and ``count`` responses, some sharing their first tokens (a small tree below it)."""
    head = random_seq(gen, prompt)
    stems = [random_seq(gen, int(n)) for n in torch.randint(1, 4, (2,), generator=gen)]
    return [head + stems[i % 2] * int(i % 3 != 0) + random_seq(gen, int(torch.randint(2, 7, (), generator=gen)))
            for i in range(count)]


@pytest.mark.parametrize("mode,kw", [
    ("dfs", dict(chunk_tokens=16)),
    ("auto", dict(max_tokens=24, chunk_tokens=8)),
])
@pytest.mark.parametrize("separable", [False, True])
@pytest.mark.parametrize("align", [1, 4], ids=["as-is", "grid4"])
@pytest.mark.parametrize("chains", [False, True], ids=["chain-off", "chain-on"])
def test_engine_exact_with_groups_after_a_prefix(mode, kw, separable, align, chains, gen, monkeypatch):
    """A long prompt's responses run as groups after it: exact with the group attention
    (``grid4``: its kernel calls on lengths padded to multiples of 4, as cuDNN's to 128), and
    every layer call of a group took it (the engine's attention routes), with the chain
    attention on or off for the prompt's pieces."""
    seqs = responses_after_prompt(gen, 37) + [random_seq(gen, 9)]
    model = get_model("qwen3")  # 4 query heads, 2 KV heads
    sizes = count_group_calls(monkeypatch)
    monkeypatch.setattr(attention, "CHAIN_AFTER_PREFIX", chains)
    monkeypatch.setattr(chain, "MATH", chain.Kernel("math", chain._math_forward, chain._math_backward, align=align))
    engine = check_engine(model, seqs, mode, RandomLoss.make(seqs, gen), separable=separable, entropy=True, **kw)
    routes = engine.stats.attention  # (the last step's: forward_backward)
    assert sizes and routes["group:math"] > 0 and "mask" not in routes, routes
    assert ("chain:math" in routes) == chains and "mask:no-kernel" not in routes, routes


@pytest.mark.parametrize("variant", ["llama-tied-mha", "qwen2-tied-mqa"])
def test_engine_groups_with_kept_attention(variant, gen, monkeypatch):
    """Recomputed groups (every leaf segment's blocks recomputed here) that keep every layer's
    attention (their backward reads the recomputed q/k/v, the own part's autograd graph
    included): exact."""
    import dataclasses

    import treerl.engine.tree_engine as tree_engine

    make_plan = tree_engine.make_plan

    def recomputing_leaves(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        plan.segments = [s if plan.children[i] else dataclasses.replace(s, recompute=True)
                         for i, s in enumerate(plan.segments)]
        return plan

    monkeypatch.setattr(tree_engine, "make_plan", recomputing_leaves)
    monkeypatch.setattr(MemoryPolicy, "kept_attention_layers",
                        lambda self, queries, keys, copies, spare, **kw: frozenset(range(self.layers)))
    kept = []
    keep = attention.KeptAttention
    monkeypatch.setattr(attention, "KeptAttention",
                        lambda inputs: kept.append(attention.active_tree_attention().group) or keep(inputs))
    model = get_model(variant, num_hidden_layers=4)
    seqs = responses_after_prompt(gen, 18, count=4)
    sizes = count_group_calls(monkeypatch)
    engine = check_engine(model, seqs, "auto", RandomLoss.make(seqs, gen), max_tokens=24, chunk_tokens=6)
    assert sizes and engine.stats.attention["group:math"] > 0 and "mask" not in engine.stats.attention
    assert any(kept) and engine.stats.attention["kept"] == len(kept), (kept, engine.stats.attention)


@pytest.mark.parametrize("chains", [False, True], ids=["chains-off", "chains-on"])
def test_attention_routes_of_a_long_prompt(chains, gen, monkeypatch):
    """The engine's attention layer calls by route on a long_prefix-shaped tree (a long prompt
    in chain pieces, its responses packed in groups), each switch off and on: the first piece
    runs SDPA's causal kernel; every layer call of a piece after the first, and of a leaf
    segment of one response (one chain after the prefix too), the chain attention (off: the
    tree mask); of a group of several responses, the group attention (off: the tree mask)."""
    prompt = random_seq(gen, 40)
    seqs = [prompt + random_seq(gen, int(n)) for n in torch.randint(3, 8, (6,), generator=gen)]
    model = get_model("qwen3")
    layers = model.config.num_hidden_layers
    monkeypatch.setattr(attention, "CHAIN_AFTER_PREFIX", chains)
    routes = {}
    for on in (False, True):
        monkeypatch.setattr(attention, "GROUPS_AFTER_PREFIX", on)
        engine = TreeEngine(model, "auto", max_tokens=20, chunk_tokens=8)
        plan = engine.plan(seqs)
        engine.forward_backward(seqs, RandomLoss.make(seqs, gen), separable=True)
        routes[on] = dict(engine.stats.attention)
    pieces = [i for i, c in enumerate(plan.children) if c]
    leaves = [s for i, s in enumerate(plan.segments) if not plan.children[i]]
    tree = PrefixTree.from_sequences(seqs)
    single = sum(int(tree.subtree_end[s.start:s.end].min()) >= s.end for s in leaves)
    groups = len(leaves) - single
    assert len(pieces) == 5 and groups >= 1, plan.describe()
    # one pass (a separable loss): each segment once, a piece that does not retain its graph twice
    # (its no-grad call, then its recompute when it closes)
    runs = [1 + int(bool(c) and not s.retain) for s, c in zip(plan.segments, plan.children)]
    assert 2 in runs, plan.describe()
    first = runs[pieces[0]]
    after = {"chain:math" if chains else "mask:chain-off": layers * (sum(runs[i] for i in pieces[1:]) + single)}
    assert routes[True] == {"causal": first * layers, **after, "group:math": layers * groups}, routes
    assert routes[False] == {"causal": first * layers, **after, "mask": layers * groups}, routes
