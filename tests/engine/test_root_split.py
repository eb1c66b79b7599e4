"""The root split (treerl.engine.attention.ROOT_SPLIT): a call without prefix whose trees (at most
ROOT_SPLIT_MAX_TREES) each start with a long root chain runs, per tree, that chain's causal attention
through the probed fused kernel (the math kernel on the CPU) and the tree's other queries as a group
after it (treerl.engine.group_attention, the root chain as its prefix), concatenated in call order.

float64 on the CPU against autograd through a dense masked softmax (output and q/k/v gradients),
also with the group's kernel calls on a grid, for one tree and for several (one of them one chain);
flex's own part for the rest's queries against the math's; the engine end to end against the
per-sequence reference with the switch on (the route counted by the engine's attention routes), with
kept attentions, and where the route must not run; the memory model's numbers.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch

import treerl.engine.attention as attention
import treerl.engine.chain_attention as chain
from helpers.attention import assert_rel, dense_reference, inputs, recording
from helpers.engine import check_engine
from helpers.forests import RandomLoss, shaped_forest
from helpers.models import get_model
from treerl import PrefixTree, TreeEngine
from treerl.engine.memory import (MemoryModel, MemoryPolicy, root_split_layer_bytes, root_split_outputs,
                                  root_split_transient)
from treerl.engine.rooted_trees import RootedTree, rooted_trees

# below the root chain: branches at its end, a 1-token node, a strict prefix, a branch deeper down
BELOW_ROOT = [(3, [(2, []), (4, [])]), (1, []), (1, [(1, []), (2, [])], True), (5, [(2, []), (3, [])])]  # 24 tokens


def rooted_tree(gen, root: int) -> tuple[torch.Tensor, torch.Tensor, tuple[RootedTree, ...]]:
    """Token indices and subtree ends of one tree whose first ``root`` tokens are its root chain,
    and the tree with its root chain's length by :func:`root_chain` (as :func:`rooted_trees` finds it)."""
    tree = PrefixTree.from_sequences(shaped_forest(gen, [(root, BELOW_ROOT)]))
    index, n = torch.arange(tree.num_tree_tokens), tree.num_tree_tokens
    assert rooted_trees(tree.subtree_end, 0) == (RootedTree(0, root_chain(tree.subtree_end, n), n),)
    return index, tree.subtree_end, rooted_trees(tree.subtree_end, 0)


def root_chain(ends: torch.Tensor, end: int) -> int:
    """The reference: how many leading tokens of a tree (subtree ends ``ends``, ending at ``end``)
    have a subtree reaching its end, counted one by one."""
    count = 0
    while count < len(ends) and int(ends[count]) >= end:
        count += 1
    return count


@pytest.fixture
def root_split(monkeypatch):
    """The switch on, its minimum lowered to 8 tokens."""
    monkeypatch.setattr(attention, "ROOT_SPLIT", True)
    monkeypatch.setattr(attention, "ROOT_SPLIT_MIN_TOKENS", 8)


def rooted_call(gen, roots: list[int], chains: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor,
                                                                          tuple[RootedTree, ...]]:
    """Token indices and subtree ends of one call of trees (in the forest's random order) whose root
    chains are ``roots`` long (each with :data:`BELOW_ROOT` after it) and of trees that are one chain
    of ``chains`` tokens, and the trees by :func:`rooted_trees`."""
    tree = PrefixTree.from_sequences(shaped_forest(gen, [(r, BELOW_ROOT) for r in roots] + [(c, []) for c in chains]))
    trees = rooted_trees(tree.subtree_end, 0)
    assert sorted(t.root for t in trees) == sorted([*roots, *chains])
    assert sorted(t.root for t in trees if not t.rest) == sorted(chains)
    return torch.arange(tree.num_tree_tokens), tree.subtree_end, trees


def test_root_chain_length():
    ends = torch.tensor([9, 9, 9, 5, 5, 9, 7, 9, 9])  # tokens 3 and 5.. are below the root chain 0..2
    assert root_chain(ends, 9) == 3
    assert root_chain(torch.tensor([9, 9, 9]), 9) == 3  # one chain: all of it
    assert root_chain(torch.tensor([2, 2, 4, 4]), 4) == 0  # two trees: none


@pytest.mark.parametrize("start", [0, 1, 2])
def test_rooted_trees_of_a_call(start, gen):
    """The trees of a call (starting at each tree of a forest, or the whole forest) and their root
    chains: contiguous, each ending at its first token's subtree end (the last one cut at the call's
    end: a call of 5 tokens less), each root chain :func:`root_chain`'s of its tree."""
    tree = PrefixTree.from_sequences(shaped_forest(gen, [(9, BELOW_ROOT), (12, []), (1, BELOW_ROOT)]))
    ends = tree.subtree_end
    first = rooted_trees(ends, 0)[start].start
    call = range(first, tree.num_tree_tokens - 5)
    trees = rooted_trees(ends[call.start:call.stop], first)
    assert trees[0].start == 0 and trees[-1].end == len(call) and len(trees) == 3 - start
    assert all(a.end == b.start for a, b in zip(trees, trees[1:]))
    for t in trees:
        assert t.end == min(int(ends[first + t.start]) - first, len(call)) and t.rest >= 0
        assert t.root == root_chain(ends[first + t.start:first + t.end], first + t.end)
    whole = rooted_trees(ends, 0)[start:]  # (the forest's trees in its random order)
    assert [t.root for t in trees] == [min(w.root, len(call) + first - w.start) for w in whole]


def route_matches_dense_attention(gen, heads: int, kv_heads: int, index: torch.Tensor, k_end: torch.Tensor,
                                  roots: tuple[RootedTree, ...]) -> attention.TreeAttention:
    """A call's attention with the split on (of trees ``roots``, kept) on random float64 inputs: its output
    and q/k/v gradients those of autograd through the dense tree mask (rel 1e-12); its context (routes)."""
    ctx = attention.TreeAttention("sdpa", index, index, k_end, roots=roots)
    ctx.routes = collections.Counter()
    assert ctx.roots == roots and ctx.input_copies
    dim = int(torch.randint(2, 9, (1,), generator=gen)) * 4
    q, k, v = inputs(gen, heads, kv_heads, len(index), len(index), dim)
    scale = float(torch.rand((), generator=gen, dtype=torch.float64)) + 0.2
    grad = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    out = attention._attend(ctx, q, k, v, scale)
    ref = dense_reference(q, k, v, attention.dense_tree_mask(index, index, k_end), scale)
    for a, b in zip((out, *torch.autograd.grad(out, (q, k, v), grad)),
                    (ref, *torch.autograd.grad(ref, (q, k, v), grad))):
        assert a.shape == b.shape
        assert_rel(a, b, 1e-12)
    return ctx


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("root,align", [(8, 1), (45, 1), (45, 16), (64, 16), (8, 16)])
def test_route_matches_dense_attention(heads, kv_heads, root, align, gen, root_split, monkeypatch):
    """Output and q/k/v gradients of the route equal autograd through the dense tree mask,
    the group's kernel calls on a grid (``align``) or not; the route is counted. A root chain
    shorter than the grid leaves the group no full part: the tree mask, exactly."""
    calls = []
    monkeypatch.setattr(chain, "MATH", recording(chain.Kernel("math", chain._math_forward, chain._math_backward,
                                                              align=align), calls))
    index, k_end, roots = rooted_tree(gen, root)
    assert [tree.root for tree in roots] == [root]
    ctx = route_matches_dense_attention(gen, heads, kv_heads, index, k_end, roots)
    if root < align:
        assert dict(ctx.routes) == {"mask:short-prefix": 1} and calls == [], (ctx.routes, calls)
        return
    assert dict(ctx.routes) == {"root:math": 1}, ctx.routes
    n, rows = len(index) - root, -(-root // align) * align
    # the group's full part and the root chain's causal part (padded to the grid), forward and backward each
    assert sorted(calls) == sorted([(-(-n // align) * align, root - root % align, False)] * 2
                                   + [(rows, rows, True)] * 2), calls


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("roots,chains", [([45, 20], []), ([20, 33], [30]), ([17, 40, 24], [])],
                         ids=["two", "three-one-chain", "three"])
@pytest.mark.parametrize("align", [1, 16], ids=["as-is", "grid16"])
def test_route_on_several_trees_matches_dense_attention(heads, kv_heads, roots, chains, align, gen, root_split,
                                                        monkeypatch):
    """Calls of 2 or 3 trees of different root chains, one of them one chain: output and q/k/v gradients
    of the route equal autograd through the dense tree mask, the kernel calls on a grid (``align``) or
    not; per tree the root chain's causal part and, unless it is one chain, its group's full part over
    the root keys on the grid; the route counted once."""
    monkeypatch.setattr(attention, "ROOT_SPLIT_MAX_TREES", 3)
    calls = []
    monkeypatch.setattr(chain, "MATH", recording(chain.Kernel("math", chain._math_forward, chain._math_backward,
                                                              align=align), calls))
    index, k_end, trees = rooted_call(gen, roots, chains)
    assert len(trees) == len(roots) + len(chains)
    ctx = route_matches_dense_attention(gen, heads, kv_heads, index, k_end, trees)
    assert dict(ctx.routes) == {"root:math": 1}, ctx.routes
    up = lambda n: -(-n // align) * align  # noqa: E731
    want = [(up(t.rest), t.root - t.root % align, False) for t in trees if t.rest] + [(up(t.root), up(t.root), True)
                                                                                    for t in trees]
    assert sorted(calls) == sorted(want * 2), calls  # forward and backward each


def test_several_trees_fall_back_where_a_group_has_no_full_part(gen, root_split, monkeypatch):
    """A tree whose root chain is shorter than the grid leaves its group no full part: the whole call
    takes the tree mask, exactly, counted once as the group's reason."""
    monkeypatch.setattr(attention, "ROOT_SPLIT_MAX_TREES", 2)
    monkeypatch.setattr(chain, "MATH", chain.Kernel("math", chain._math_forward, chain._math_backward, align=16))
    index, k_end, trees = rooted_call(gen, [45, 8])
    ctx = route_matches_dense_attention(gen, 4, 2, index, k_end, trees)
    assert dict(ctx.routes) == {"mask:short-prefix": 1}, ctx.routes


def test_when_the_route_runs_on_several_trees(gen, root_split, monkeypatch):
    """At most ROOT_SPLIT_MAX_TREES trees (1 by default), every one with a root chain of at least the
    minimum, some not one chain, the trees covering the call each as one block (checked on the CPU)."""
    assert attention.ROOT_SPLIT_MAX_TREES == 1
    index, k_end, trees = rooted_call(gen, [20, 26], [22])
    make = lambda roots: attention.TreeAttention("sdpa", index, index, k_end, roots=roots).roots  # noqa: E731
    assert make(trees) == ()  # 3 trees, at most 1
    monkeypatch.setattr(attention, "ROOT_SPLIT_MAX_TREES", 2)
    assert make(trees) == ()  # 3 trees, at most 2
    monkeypatch.setattr(attention, "ROOT_SPLIT_MAX_TREES", 3)
    assert make(trees) == trees
    monkeypatch.setattr(attention, "ROOT_SPLIT_MIN_TOKENS", 21)
    assert make(trees) == ()  # one root chain of 20 tokens
    monkeypatch.setattr(attention, "ROOT_SPLIT_MIN_TOKENS", 8)
    assert make(trees[:-1]) == () and make(trees[1:]) == ()  # not the whole call
    i = next(i for i, t in enumerate(trees) if t.rest)  # a tree with a group
    tree = trees[i]
    longer = tree._replace(root=tree.root + 1)
    assert make(trees[:i] + (longer,) + trees[i + 1:]) == ()  # a token below its root chain taken into it
    merged = (RootedTree(0, trees[0].root, trees[1].end),) + trees[2:]
    assert make(merged) == ()  # two trees as one: the second does not see the first's root chain
    monkeypatch.setattr(attention, "ROOT_SPLIT_MIN_TOKENS", 1)
    cut = (tree._replace(end=tree.end - 1), RootedTree(tree.end - 1, 1, tree.end))
    assert make(trees[:i] + cut + trees[i + 1:]) == ()  # its last token as a tree after it: its keys seen past it
    index, k_end, chains = rooted_call(gen, [], [20, 24])
    assert attention.TreeAttention("sdpa", index, index, k_end, roots=chains).roots == ()  # no group: one chain each


@pytest.mark.parametrize("root,first", [(45, 45), (45, 32), (130, 128), (256, 256)])
def test_flex_own_part_of_the_rest_matches_the_math(root, first, gen, monkeypatch):
    """The rest's own part through flex (eager forward on the CPU) over the root keys from
    ``first`` on and its own keys: the output and log-sum-exp of the math's."""
    monkeypatch.setattr(attention, "_FLEX_TILES", attention._flex_whole_tiles)  # eager flex: no CPU compile
    monkeypatch.setattr(attention, "_FLEX_ANY", attention._flex_any)
    index, k_end, _ = rooted_tree(gen, root)
    q, k, v = (x.detach() for x in inputs(gen, 4, 2, len(index), len(index), 16))
    flex_ctx, math_ctx = (attention.TreeAttention(b, index, index, k_end) for b in ("flex", "sdpa"))
    rest, k_own, v_own = q[:, :, root:], k[:, :, first:], v[:, :, first:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is not compiled
        out, lse = attention._own(flex_ctx, rest, k_own, v_own, first, 0.3, rows=root)
    ref_out, ref_lse = attention._own(math_ctx, rest, k_own, v_own, first, 0.3, rows=root)
    assert out.shape == rest.shape
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("align", [1, 32])
def test_flex_own_part_of_a_tree_block_matches_the_math(align, gen, monkeypatch):
    """Each tree's own part of a call of several (its rest's queries over its root keys off the grid and
    its own keys, up to the tree's end) through flex (eager forward on the CPU): the output and
    log-sum-exp of the math's; the bounded masks are the dense mask's blocks, built once per block."""
    monkeypatch.setattr(attention, "_FLEX_TILES", attention._flex_whole_tiles)  # eager flex: no CPU compile
    monkeypatch.setattr(attention, "_FLEX_ANY", attention._flex_any)
    index, k_end, trees = rooted_call(gen, [45, 130], [20])
    q, k, v = (x.detach() for x in inputs(gen, 4, 2, len(index), len(index), 16))
    flex_ctx, math_ctx = (attention.TreeAttention(b, index, index, k_end) for b in ("flex", "sdpa"))
    dense = attention.dense_tree_mask(index, index, k_end)
    for tree in (t for t in trees if t.rest):
        rows, first = tree.start + tree.root, tree.start + tree.root - tree.root % align
        mask = math_ctx.own_mask(first, rows, tree.end)
        assert torch.equal(mask, dense[rows:tree.end, first:tree.end])
        assert math_ctx.own_mask(first, rows, tree.end) is mask  # (cached)
        rest, k_own, v_own = q[:, :, rows:tree.end], k[:, :, first:tree.end], v[:, :, first:tree.end]
        kw = dict(rows=rows, start=tree.start, stop=tree.end)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex warns that it is not compiled
            out, lse = attention._own(flex_ctx, rest, k_own, v_own, first - tree.start, 0.3, **kw)
        ref_out, ref_lse = attention._own(math_ctx, rest, k_own, v_own, first - tree.start, 0.3, **kw)
        assert out.shape == rest.shape
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    assert len(math_ctx._own_masks) == 2 and len(flex_ctx._own_masks) == 2


def test_route_names_both_kernels_where_they_differ(gen, root_split, monkeypatch):
    """The route's label names the root chain's kernel, and the group's after it where it is another
    (one shape past cuDNN's bound takes the next kernel); the output stays exact."""
    other = dataclasses.replace(chain.MATH, name="other")
    monkeypatch.setattr(attention, "kernel_for", lambda q, k, causal=True: chain.MATH if causal else other)
    index, k_end, roots = rooted_tree(gen, 20)
    ctx = attention.TreeAttention("sdpa", index, index, k_end, roots=roots)
    ctx.routes = collections.Counter()
    q, k, v = inputs(gen, 4, 2, len(index), len(index), 8)
    out = attention._attend(ctx, q, k, v, None)
    assert dict(ctx.routes) == {"root:math+other": 1}, ctx.routes
    assert_rel(out, dense_reference(q, k, v, attention.dense_tree_mask(index, index, k_end), 8 ** -0.5), 1e-12)


def test_when_the_route_runs(gen, monkeypatch):
    """On for CUDA tensors by default; on only without prefix, not one chain, a root chain of at least the
    minimum and short of the whole call, its keys seen by every later query."""
    assert attention.ROOT_SPLIT == "cuda" and attention.ROOT_SPLIT_MIN_TOKENS == 4096
    index, k_end, r = rooted_tree(gen, 20)
    make = lambda root, **kw: attention.TreeAttention(  # noqa: E731
        "sdpa", index, index, k_end, roots=(RootedTree(0, root, len(index)),), **kw).roots
    monkeypatch.setattr(attention, "ROOT_SPLIT", False)
    assert make(20) == ()  # the switch off
    monkeypatch.setattr(attention, "ROOT_SPLIT", "cuda")
    assert make(20) == ()  # CPU tensors
    monkeypatch.setattr(attention, "ROOT_SPLIT", True)
    assert make(20) == ()  # under 4096 tokens
    monkeypatch.setattr(attention, "ROOT_SPLIT_MIN_TOKENS", 20)
    assert make(20) == r and make(19) == ()
    assert make(20, causal=True) == () and make(len(index)) == ()
    assert make(21) == ()  # token 20 is below the root chain: not seen by every later query
    meta = index.to("meta")  # a device that is not the CPU: flex only (the SDPA backend has no own part there)
    assert attention.TreeAttention("flex", meta, meta, k_end.to("meta"), roots=r).roots == r
    assert attention.TreeAttention("sdpa", meta, meta, k_end.to("meta"), roots=r).roots == ()
    monkeypatch.setattr(attention, "ROOT_SPLIT_MIN_TOKENS", 0)
    assert make(0) == ()


# ------------------------------------------------------------------ the engine
def rooted_forest(gen, trees: int | list[int], root: int = 14, lone: int = 0) -> list[list[int]]:
    """``trees`` trees of a ``root``-token prompt (the root chain; or one tree per prompt length of
    the list ``trees``) and 4 responses, two of them sharing their first tokens (``root + 20`` tokens
    each: calls of ``max_tokens=root + 20`` run one each), and with ``lone`` a sequence of that many
    tokens sharing nothing."""
    roots = [root] * trees if isinstance(trees, int) else trees
    below = [(2, [(4, []), (6, [])]), (3, []), (5, [])]
    return shaped_forest(gen, [(r, below) for r in roots] + [(lone, [])] * bool(lone))


@pytest.mark.parametrize("mode", ["auto", "packed"])
@pytest.mark.parametrize("separable", [False, True])
@pytest.mark.parametrize("align", [1, 4], ids=["as-is", "grid4"])
def test_engine_exact_with_the_root_split(mode, separable, align, gen, root_split, monkeypatch):
    """Trees of a prompt and its responses, one call each: every layer call of each runs the
    root split (the engine's attention routes), exactly; a lone sequence runs SDPA's causal kernel."""
    monkeypatch.setattr(chain, "MATH", chain.Kernel("math", chain._math_forward, chain._math_backward, align=align))
    seqs = rooted_forest(gen, 3, lone=9)
    model = get_model("qwen3")
    engine = check_engine(model, seqs, mode, RandomLoss.make(seqs, gen), separable=separable, entropy=True,
                          max_tokens=34)
    routes = engine.stats.attention  # (the last step's: forward_backward)
    assert set(routes) == {"root:math", "causal"} and routes["root:math"] >= 3 * model.config.num_hidden_layers, routes


@pytest.fixture
def keep_all(monkeypatch) -> tuple[list, list]:
    """Every call recomputed, keeping every layer's attention: (the trees the memory policy was told
    per call, the trees of each kept attention's call)."""
    import treerl.engine.tree_engine as tree_engine

    make_plan = tree_engine.make_plan

    def recomputing(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        plan.segments = [dataclasses.replace(s, recompute=True) for s in plan.segments]
        return plan

    roots_told = []
    monkeypatch.setattr(tree_engine, "make_plan", recomputing)
    monkeypatch.setattr(MemoryPolicy, "kept_attention_layers", lambda self, queries, keys, copies, spare,
                        alone=False, roots=(): roots_told.append(roots) or frozenset(range(self.layers)))
    kept = []
    keep = attention.KeptAttention
    monkeypatch.setattr(attention, "KeptAttention",
                        lambda inputs: kept.append(attention.active_tree_attention().roots) or keep(inputs))
    return roots_told, kept


@pytest.mark.parametrize("variant", ["llama-tied-mha", "qwen2-tied-mqa"])
@pytest.mark.parametrize("separable", [False, True])
def test_engine_root_split_with_kept_attention(variant, separable, gen, root_split, keep_all):
    """Recomputed calls (every one here) that keep every layer's attention (their backward reads
    the recomputed q/k/v, the root's SDPA and the group's autograd graphs included): exact; the
    memory policy was told each call's root chain."""
    roots_told, kept = keep_all
    model = get_model(variant, num_hidden_layers=4)
    seqs = rooted_forest(gen, 2)
    engine = check_engine(model, seqs, "auto", RandomLoss.make(seqs, gen), separable=separable,
                          max_tokens=34)
    routes = engine.stats.attention
    assert routes["root:math"] > 0 and set(routes) == {"root:math", "kept"}, routes
    assert kept and all(kept) and routes["kept"] == len(kept), (kept, routes)
    assert roots_told and all([tree.root for tree in roots] == [14] for roots in roots_told), roots_told  # (the prompt)


@pytest.mark.parametrize("mode", ["auto", "packed"])
@pytest.mark.parametrize("separable", [False, True])
@pytest.mark.parametrize("align", [1, 4], ids=["as-is", "grid4"])
def test_engine_exact_with_the_root_split_of_several_trees(mode, separable, align, gen, root_split, monkeypatch):
    """Trees of prompts of different lengths and a lone sequence (a tree that is one chain), all in one
    call (ROOT_SPLIT_MAX_TREES raised): every layer call runs the root split over its 3 trees, exactly."""
    monkeypatch.setattr(attention, "ROOT_SPLIT_MAX_TREES", 8)
    monkeypatch.setattr(chain, "MATH", chain.Kernel("math", chain._math_forward, chain._math_backward, align=align))
    seqs = rooted_forest(gen, [14, 10], lone=9)
    model = get_model("qwen3")
    engine = check_engine(model, seqs, mode, RandomLoss.make(seqs, gen), separable=separable, entropy=True,
                          max_tokens=1000)
    assert len(engine.plan(seqs).segments) == 1
    routes = engine.stats.attention  # (the last step's: forward_backward)
    assert dict(routes) == {"root:math": engine.stats.model_calls * model.config.num_hidden_layers}, routes


@pytest.mark.parametrize("variant", ["llama-tied-mha", "qwen2-tied-mqa"])
def test_engine_root_split_of_several_trees_with_kept_attention(variant, gen, root_split, keep_all, monkeypatch):
    """A recomputed call of 3 trees keeping every layer's attention: exact; the memory policy was
    told its trees."""
    monkeypatch.setattr(attention, "ROOT_SPLIT_MAX_TREES", 8)
    roots_told, kept = keep_all
    model = get_model(variant, num_hidden_layers=4)
    seqs = rooted_forest(gen, [14, 10], lone=9)
    engine = check_engine(model, seqs, "packed", RandomLoss.make(seqs, gen), max_tokens=1000)
    routes = engine.stats.attention
    assert routes["root:math"] > 0 and set(routes) == {"root:math", "kept"}, routes
    assert kept and all(len(roots) == 3 for roots in kept) and routes["kept"] == len(kept), (kept, routes)
    assert roots_told and all(sorted(t.root for t in roots) == [9, 10, 14] for roots in roots_told), roots_told


@pytest.mark.parametrize("case", ["one-short", "too-many"])
def test_engine_does_not_split_several_trees_where_it_should_not(case, gen, root_split, monkeypatch):
    """A call of several trees, one of whose root chains is under the minimum, or of more trees than
    ROOT_SPLIT_MAX_TREES: the tree mask."""
    monkeypatch.setattr(attention, "ROOT_SPLIT_MAX_TREES", 8 if case == "one-short" else 2)
    seqs = rooted_forest(gen, [14, 6] if case == "one-short" else [14, 10, 9])
    model = get_model("qwen3")
    engine = TreeEngine(model, "packed", max_tokens=1000)
    engine.forward_backward(seqs, RandomLoss.make(seqs, gen), separable=True)
    assert dict(engine.stats.attention) == {"mask": model.config.num_hidden_layers}, engine.stats.attention


@pytest.mark.parametrize("case", ["off", "short", "packed"])
def test_engine_does_not_split_where_it_should_not(case, gen, monkeypatch):
    """The switch off, a root chain under the minimum, or a call of several trees: the tree
    mask, as before (and the memory policy hears of no root chain)."""
    monkeypatch.setattr(attention, "ROOT_SPLIT", case != "off")
    monkeypatch.setattr(attention, "ROOT_SPLIT_MIN_TOKENS", 15 if case == "short" else 8)
    seqs = rooted_forest(gen, 2)
    max_tokens = 1000 if case == "packed" else 34
    model = get_model("qwen3")
    engine = TreeEngine(model, "packed", max_tokens=max_tokens)
    assert len(engine.plan(seqs).segments) == (1 if case == "packed" else 2)
    engine.forward_backward(seqs, RandomLoss.make(seqs, gen), separable=True)
    assert dict(engine.stats.attention) == {"mask": 2 * model.config.num_hidden_layers if case != "packed"
                                            else model.config.num_hidden_layers}, engine.stats.attention


def test_memory_model_counts_the_root_split():
    """A kept root-split attention holds (2N + n) / N outputs per query (n = N - r: the call's,
    the root's, the group's merged and its own part's) and input copies for its own part's flex
    only (the n other queries over their own keys and the root keys off the kernel's grid);
    other calls' numbers unchanged."""
    model = get_model("qwen3", num_hidden_layers=16)
    m = MemoryModel.estimate(model.config, torch.float64)
    one = lambda n, r: (RootedTree(0, r, n),)  # noqa: E731
    assert root_split_outputs(100, ()) == 1.0 and root_split_outputs(100, one(100, 60)) == pytest.approx(2.4)
    per_layer = root_split_layer_bytes(m, 100, one(100, 60))
    assert per_layer == pytest.approx(100 * 2.4 * m.attention_per_query + 40 * m.attention_copies_per_query
                                      + (40 + 60) * m.attention_copies_per_key)  # 60 % 128: all 60 root keys
    assert root_split_layer_bytes(m, 300, one(300, 256)) == pytest.approx(
        300 * (900 - 256) / 300 * m.attention_per_query + 44 * (m.attention_copies_per_query
                                                                 + m.attention_copies_per_key))
    plain_query, plain_key, plain_pair = m._kept_layer_bytes(True)
    plain = 100 * plain_query + 100 * plain_key + 100 * 100 * plain_pair
    transient = root_split_transient(m, 100)  # the split's outputs beside the call's while a layer runs
    assert transient == 2 * 100 * m.attention_per_query
    assert m.kept_attention_layers(5.5 * per_layer + transient, 100, 100, 16, True, roots=one(100, 60)) == 5
    assert m.kept_attention_layers(5.5 * per_layer, 100, 100, 16, True, roots=one(100, 60)) == int(
        (5.5 * per_layer - transient) // per_layer)
    assert m.kept_attention_layers(5.5 * plain, 100, 100, 16, True) == 5  # without the split: as before


def test_memory_model_counts_the_root_split_of_several_trees():
    """Several trees: (2N + n) / N outputs per query, n the queries after the root chains, and per
    tree with a group the input copies of its own part (a tree that is one chain has none)."""
    model = get_model("qwen3", num_hidden_layers=16)
    m = MemoryModel.estimate(model.config, torch.float64)
    trees = (RootedTree(0, 60, 100), RootedTree(100, 30, 130), RootedTree(130, 140, 330))  # the middle one a chain
    assert root_split_outputs(330, trees) == pytest.approx((660 + 40 + 200 - 140) / 330)
    per_layer = root_split_layer_bytes(m, 330, trees)
    assert per_layer == pytest.approx(760 * m.attention_per_query + 100 * m.attention_copies_per_query
                                      + (40 + 60 + 60 + 140 % 128) * m.attention_copies_per_key)
    transient = root_split_transient(m, 330)
    assert m.kept_attention_layers(3.5 * per_layer + transient, 330, 330, 16, True, roots=trees) == 3
    one = root_split_layer_bytes(m, 100, trees[:1])  # the first tree alone: as a call of one tree
    assert one == pytest.approx(100 * 2.4 * m.attention_per_query + 40 * m.attention_copies_per_query
                                + 100 * m.attention_copies_per_key)
