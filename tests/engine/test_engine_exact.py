"""Every engine mode against an independent per-sequence Hugging Face forward.

float64: logprobs, entropies and every parameter's gradient agree to 1e-9 (relative);
float32: to 1e-5. Plans are checked so that the configurations claimed to be exercised
(chains, several segments, recomputed and retained chains, split nodes) really are.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.engine import MODES, SPEC, check_engine, general_peak, plan_features
from helpers.forests import RandomLoss, TokenwiseLoss, forests, longest_node, random_seq, shaped_forest, tree_sizes
from helpers.models import VARIANTS, VOCAB, get_model
from helpers.reference import (
    assert_grads_close,
    assert_seq_close,
    grads_of,
    reference_logprobs,
    reference_step,
    zero_grads,
)
from treerl import PrefixTree, TreeEngine, TreeTooLargeError, make_plan
from treerl.engine.attention import TreeAttention, dense_tree_mask, tree_attention_enabled

HYP = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def engine_setups(draw, mode, alphabets=None):
    seqs = draw(forests(max_seqs=6, max_len=14, alphabets=alphabets))
    tree = PrefixTree.from_sequences(seqs)
    longest_seq = max(map(len, seqs))
    if mode == "flat":  # half the time below the longest sequence: it runs as a chain of pieces
        short = st.integers(1, max(1, longest_seq - 1))
        max_tokens = draw(st.one_of(short, st.integers(longest_seq, sum(map(len, seqs)) + 2)))
    elif mode == "packed":
        max_tokens = draw(st.integers(max(tree_sizes(tree)), tree.num_tree_tokens + 2))
    else:
        max_tokens = draw(st.integers(1, tree.num_tree_tokens + 2))
    chunk_tokens = draw(st.integers(1, longest_node(tree) + 2))
    separable = draw(st.booleans())
    return dict(
        seqs=seqs,
        variant=draw(st.sampled_from(list(VARIANTS))),
        max_tokens=max_tokens,
        chunk_tokens=chunk_tokens,
        entropy=draw(st.booleans()),
        separable=separable,
        coupled=not separable and draw(st.booleans()),
        temperature=draw(st.sampled_from([1.0, 1.0, 0.7, 1.6])),
        tree_input=draw(st.sampled_from(["list", "tensors", "tree", "unshared_tree"])),
        # loss head in chunks of 1, 3 or all rows of logits
        logits_chunk_elements=draw(st.sampled_from([None, VOCAB, 3 * VOCAB + 5])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def run_setup(setup, mode, dtype):
    model = get_model(setup["variant"], dtype)
    loss = RandomLoss.make(
        setup["seqs"], torch.Generator().manual_seed(setup["seed"]), coupled=setup["coupled"],
        dtype=torch.promote_types(dtype, torch.float32), one_sign=dtype == torch.float32,
    )
    check_engine(
        model, setup["seqs"], mode, loss,
        **{k: setup[k] for k in ("max_tokens", "chunk_tokens", "entropy", "separable", "temperature", "tree_input", "logits_chunk_elements")},
    )


# ------------------------------------------------------------------ random forests
@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=50, **HYP)
@given(data=st.data())
def test_float64_random_forests(mode, data):
    run_setup(data.draw(engine_setups(mode)), mode, torch.float64)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=20, **HYP)
@given(data=st.data())
def test_float32_random_forests(mode, data):
    # Full alphabet: degenerate repeated-token inputs make some float32 gradients pure
    # cancellation noise in the reference too (covered in float64 above).
    run_setup(data.draw(engine_setups(mode, alphabets=[VOCAB])), mode, torch.float32)


# ---------------------------------------------------- every family, every mode
MODE_KW = {
    "flat": dict(max_tokens=20),  # several micro-batches of whole sequences
    # trees of 39, 17 and 5 tokens -> at least two calls; loss head 2 rows at a time
    "packed": dict(max_tokens=48, logits_chunk_elements=2 * VOCAB),
    # nodes split in pieces, chains retained and recomputed; loss head 1 row at a time
    "dfs": dict(chunk_tokens=5, logits_chunk_elements=VOCAB),
    "auto": dict(max_tokens=13, chunk_tokens=4),  # chains, retained and recomputed
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_every_family_and_mode(mode, variant, dtype, gen):
    seqs = shaped_forest(gen, SPEC)
    model = get_model(variant, dtype)
    engine = TreeEngine(model, mode, **MODE_KW[mode])
    feats = plan_features(engine.plan(seqs))
    assert feats["segments"] >= 2, feats
    if mode in ("dfs", "auto"):
        assert feats["chains"] >= 2 and feats["recomputed"] >= 1 and feats["retained"] >= 1, feats
    loss = RandomLoss.make(seqs, gen, coupled=True, one_sign=dtype == torch.float32)
    check_engine(model, seqs, mode, loss, entropy=True, **MODE_KW[mode])


# ------------------------------------------------------------ plan-specific runs
def test_auto_plan_chains_segments_and_both_chain_kinds(gen):
    seqs = shaped_forest(gen, SPEC)
    tree = PrefixTree.from_sequences(seqs)
    model = get_model("qwen3")
    seen = set()
    for max_tokens, chunk in [(13, 4), (25, 4), (9, 3), (17, 100), (5, 2), (tree.num_tree_tokens, 7)]:
        plan = TreeEngine(model, "auto", max_tokens=max_tokens, chunk_tokens=chunk).plan(tree)
        f = plan_features(plan)
        seen |= {k for k, v in f.items() if v and k != "segments"}
        assert max(s.size for s in plan.segments) <= max_tokens
        assert plan.peak_live_tokens() <= max_tokens
        for separable in (False, True):
            loss = RandomLoss.make(seqs, gen)
            check_engine(model, seqs, "auto", loss, max_tokens=max_tokens, chunk_tokens=chunk, separable=separable, entropy=separable)
    # the sweep covered every kind of segment
    assert seen == {"chains", "recomputed", "retained", "with_prefix"}, seen
    # max_tokens = the whole forest: every tree runs packed, one call per tree group
    assert TreeEngine(model, "auto", max_tokens=tree.num_tree_tokens).plan(tree).single_level


def test_packed_and_flat_several_micro_batches(gen):
    seqs = shaped_forest(gen, SPEC)
    tree = PrefixTree.from_sequences(seqs)
    model = get_model("qwen2")
    assert sorted(tree_sizes(tree)) == [5, 17, 39]
    for mode, max_tokens in [("packed", 39), ("packed", 44), ("flat", 15), ("flat", 30)]:
        engine = TreeEngine(model, mode, max_tokens=max_tokens)
        plan = engine.plan(tree)
        assert plan.single_level and len(plan.segments) >= 2
        assert all(s.size <= max_tokens for s in plan.segments)
        covered = sorted(t for s in plan.segments for t in range(s.start, s.end))
        n = tree.num_tree_tokens if mode == "packed" else tree.num_flat_tokens
        assert covered == list(range(n))
        for separable in (False, True):
            loss = RandomLoss.make(seqs, gen)
            check_engine(model, seqs, mode, loss, max_tokens=max_tokens, separable=separable)
            if separable:  # one loss call per micro-batch, each with its own sequences
                assert len(loss.calls) == len(plan.segments)


@pytest.mark.parametrize("max_tokens", [1, 4, 10, 14])
@pytest.mark.parametrize("loss_kind", ["separable", "coupled", "gspo"])
def test_flat_sequences_longer_than_max_tokens(max_tokens, loss_kind, gen):
    """flat runs a sequence longer than max_tokens as a chain of pieces (each after the
    earlier pieces' K/V); sequences that fit are still packed several per call. Both the
    two-phase path (non-separable loss) and separable losses, with entropies."""
    seqs = sorted(shaped_forest(gen, SPEC), key=len)  # flat keeps the input order: short ones adjacent
    lengths = list(map(len, seqs))
    assert lengths[-1] == 15 and lengths[:4] == [5, 8, 8, 8]
    model = get_model("qwen3")
    plan = TreeEngine(model, "flat", max_tokens=max_tokens).plan(seqs)
    f = plan_features(plan)
    long = [n for n in lengths if n > max_tokens]
    assert f["chains"] == sum(-(-n // max_tokens) - 1 for n in long) >= 1, f
    assert f["recomputed"] == f["chains"] and f["with_prefix"] == f["chains"], f
    assert max(s.size for s in plan.segments) <= max_tokens
    assert plan.peak_live_tokens() <= max_tokens
    whole = [i for i, s in enumerate(plan.segments) if s.parent < 0 and not plan.children[i]]
    if max_tokens >= 13:  # sequences that fit still share calls (5 + 8 tokens)
        assert len(whole) < sum(1 for n in lengths if n <= max_tokens), plan.describe()
    if loss_kind == "gspo":
        lps, _ = reference_logprobs(model, seqs)
        old = [lp.detach() + 0.05 * torch.randn(lp.shape, generator=gen, dtype=lp.dtype) for lp in lps]
        loss, entropy = GSPO(seqs, gen, old), False
    else:
        loss, entropy = RandomLoss.make(seqs, gen, coupled=loss_kind == "coupled"), True
    for separable in (False, True) if loss_kind != "coupled" else (False,):
        check_engine(model, seqs, "flat", loss, max_tokens=max_tokens, separable=separable, entropy=entropy)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_flat_chained_every_family(variant, dtype, gen):
    seqs = shaped_forest(gen, SPEC)
    model = get_model(variant, dtype)
    loss = RandomLoss.make(seqs, gen, coupled=True, one_sign=dtype == torch.float32)
    check_engine(model, seqs, "flat", loss, max_tokens=6, entropy=True, logits_chunk_elements=VOCAB)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 11, 12, 40])
def test_dfs_chunk_sizes(chunk, gen):
    seqs = shaped_forest(gen, SPEC)
    tree = PrefixTree.from_sequences(seqs)
    assert longest_node(tree) == 12
    model = get_model("llama")
    engine = TreeEngine(model, "dfs", chunk_tokens=chunk, max_tokens=8)  # max_tokens unused by dfs
    plan = engine.plan(tree)
    assert max(s.size for s in plan.segments) <= chunk
    assert plan.peak_live_tokens() <= chunk
    node_of = tree.node_of_token()
    split_nodes = {int(node_of[s.start]) for s in plan.segments if s.start > 0 and node_of[s.start] == node_of[s.start - 1]}
    if chunk < 12:
        assert split_nodes, "no node was split in chunks"
    else:
        assert not split_nodes
    loss = RandomLoss.make(seqs, gen, coupled=True)
    check_engine(model, seqs, "dfs", loss, chunk_tokens=chunk, entropy=chunk % 2 == 1)


# ------------------------------------ the general path: graphs held within the budget
# Six trees of 14, 9, 16, 12, 15 and 15 tokens (81 in all), and one of 30 that splits into
# chains under the budgets below.
GENERAL_SPEC = [(6, [(4, []), (5, [])]), (7, [(3, []), (2, []), (4, [])]), (9, []), (5, [(6, []), (3, [])]),
                (8, [(2, []), (5, [])]), (3, [(9, [])])]
CHAINED_SPEC = [(18, [(6, []), (6, [])])]


def general_model():
    """A memory model in round numbers (per token: 1 MB held, 220 kB with block recompute,
    of which 20 kB between a recomputing call's forward and its backward, as for 8 layers),
    so that budgets of a few MB make the choices of the general path (the planning is all
    they change)."""
    from treerl.engine.memory import MemoryModel

    return MemoryModel(fixed=0.0, per_token=1e6, recompute_per_token=2.2e5, attention_per_query=2e3,
                       kv_per_token=2e4, layers=8)


@pytest.mark.parametrize("mode", ["packed", "auto", "flat"])
@pytest.mark.parametrize("case", ["as_planned", "regrouped", "fallback", "chained"])
def test_general_path_holds_graphs_within_the_budget(mode, case, gen, monkeypatch):
    """A loss that is not separable over several calls: the calls whose graphs fit the
    budget hold them until the loss (no phase-1 forward), recomputing their blocks where
    that lets more of them fit, regrouped into smaller calls where the plan's are too large
    for all (``regrouped``), the rest through two phases (``fallback``: a budget too tight
    for all of them; ``chained``: beside a tree that splits into chains). Exact in float64
    against the per-sequence reference, and the held graphs within the budget."""
    from treerl.engine import two_phase
    from treerl.engine.memory import MemoryPolicy

    if case == "chained" and mode != "auto":
        pytest.skip("chains under a budget: auto")
    model = get_model("qwen3")
    monkeypatch.setattr(MemoryPolicy, "_measure", lambda self: general_model())
    seqs = shaped_forest(gen, GENERAL_SPEC + (CHAINED_SPEC if case == "chained" else []))

    def outcome(budget: int, chunk: int):
        engine = TreeEngine(model, mode, memory_budget=budget, chunk_tokens=chunk)
        try:
            batch = engine._prepare(seqs)
        except TreeTooLargeError:  # packed: a tree larger than a call
            return (False,) * 5
        regrouped, kept = two_phase.general_plan(engine, batch)
        plan = regrouped.plan
        assert kept == two_phase.keep_graphs(plan, engine.memory.call_budget)  # the returned plan's
        standalone = two_phase.standalone_segments(plan)
        every = len(kept) == len(standalone) > 1 and not any(plan.children)
        found = {
            "as_planned": every and regrouped is batch
            and all(kept[i].recompute == plan.segments[i].recompute for i in kept),
            # (regrouped only where it saves forward tokens: held graphs, usually all of them)
            "regrouped": regrouped is not batch and len(kept) > 1 and not any(plan.children),
            "fallback": 0 < len(kept) < len(standalone) and regrouped is batch and not any(plan.children),
            "chained": len(kept) > 0 and any(plan.children),
        }[case]
        return found, engine, plan, kept, standalone

    # The layout order (and so the grouping) depends on the random tokens: the budget of
    # the case is found by the planner's own choices. chunk_tokens bounds regrouped calls
    # from below (2 or 30 tokens).
    for budget, chunk in ((int(x * 5e5), c) for x in range(4, 140) for c in (2, 30)):
        found, engine, plan, kept, standalone = outcome(budget, chunk)
        if found:
            break
    assert found, f"no budget gives the case {case}"
    kw = dict(memory_budget=budget, chunk_tokens=chunk)
    assert general_peak(plan, kept, engine.memory.model) <= budget

    runs = {}
    for separable in (True, False):
        loss = RandomLoss.make(seqs, gen, coupled=not separable)
        run = check_engine(model, seqs, mode, loss, entropy=True, separable=separable, **kw)
        runs[separable] = run.stats
    assert runs[False].kept_graphs == len(kept)
    if case != "chained":  # every call once, and phase 1's forward of the calls not held
        extra = sum(plan.segments[i].size for i in standalone if i not in kept)
        assert runs[False].tokens_run == sum(s.size for s in plan.segments) + extra


# ---------------------------------------------------------------- loss variants
@pytest.mark.parametrize("mode", MODES)
def test_separable_equals_non_separable(mode, gen):
    seqs = shaped_forest(gen, SPEC)
    model = get_model("qwen3-tied")
    kw = MODE_KW[mode]
    loss = RandomLoss.make(seqs, gen)
    out = {}
    for separable in (False, True):
        engine = TreeEngine(model, mode, **kw)
        zero_grads(model)
        loss.calls.clear()
        value = engine.forward_backward(seqs, loss, separable=separable, entropy=True)
        out[separable] = (value, grads_of(model), list(loss.calls))
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-12)
    assert_grads_close(out[True][1], out[False][1], 1e-12, 1e-6)
    if mode in ("flat", "packed"):  # single-level: the separable path is per micro-batch
        assert len(out[True][2]) >= 2 and len(out[False][2]) == 1
    zero_grads(model)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("entropy", [False, True])
def test_token_loss_through_the_fused_head(mode, entropy, gen):
    """A loss that is a sum of per-token terms (``token_loss``): single-level plans take the
    head's gradients in its forward (one logits product a chunk); every mode stays exact."""
    seqs = shaped_forest(gen, SPEC)
    model = get_model("qwen3-tied")
    loss = TokenwiseLoss(seqs, gen)
    check_engine(model, seqs, mode, loss, separable=True, entropy=entropy, **MODE_KW[mode])
    if mode in ("flat", "packed"):  # single-level plans: every call through the fused head
        assert loss.token_calls > 0


@given(data=st.data())
@settings(max_examples=25, **HYP)
def test_token_loss_random_forests_float64(data):
    """Random forests (duplicates, strict prefixes, 1-token nodes) through the fused head:
    flat and packed plans of several calls, logits chunks of 1-3 rows."""
    seqs = data.draw(forests())
    mode = data.draw(st.sampled_from(["flat", "packed"]))
    largest = max(len(s) for s in seqs) if mode == "flat" else max(tree_sizes(PrefixTree.from_sequences(seqs)))
    max_tokens = data.draw(st.integers(largest, max(largest, 64)))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    loss = TokenwiseLoss(seqs, gen, one_sign=data.draw(st.booleans()))
    check_engine(get_model("qwen3-tied"), seqs, mode, loss, separable=True, entropy=data.draw(st.booleans()),
                 max_tokens=max_tokens, logits_chunk_elements=data.draw(st.integers(1, 3)) * VOCAB)


class OnlyEntropy:
    """A loss of the entropies alone (the logprobs get no gradient)."""

    def __init__(self, seqs, gen):
        self.w = [torch.randn(len(s) - 1, generator=gen, dtype=torch.float64) for s in seqs]
        self.calls = []

    def __call__(self, lps, ents, index=None):
        idx = range(len(lps)) if index is None else index.tolist()
        self.calls.append(list(idx))
        return sum((self.w[i] * h).sum() for i, h in zip(idx, ents))


class OnlyLogprobsWithEntropy(OnlyEntropy):
    """entropy=True, but the loss ignores the entropies."""

    def __call__(self, lps, ents, index=None):
        idx = range(len(lps)) if index is None else index.tolist()
        self.calls.append(list(idx))
        return sum(torch.exp((self.w[i] * lp).sum() / 10) for i, lp in zip(idx, lps))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", [OnlyEntropy, OnlyLogprobsWithEntropy])
def test_entropy_losses(mode, kind, gen):
    seqs = shaped_forest(gen, SPEC)
    model = get_model("llama-tied-mha")
    for separable in (False, True):
        check_engine(model, seqs, mode, kind(seqs, gen), entropy=True, separable=separable, **MODE_KW[mode])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature(mode, temperature, gen):
    seqs = shaped_forest(gen, SPEC)
    model = get_model("qwen3")
    plain = TreeEngine(model, mode, **MODE_KW[mode]).logprobs(seqs)
    hot = TreeEngine(model, mode, temperature=temperature, **MODE_KW[mode]).logprobs(seqs)
    # the temperature really changes the numbers (else this test proves nothing)
    assert (torch.cat(plain) - torch.cat(hot)).abs().max() > 1e-2
    loss = RandomLoss.make(seqs, gen)
    check_engine(model, seqs, mode, loss, entropy=True, temperature=temperature, **MODE_KW[mode])


class GSPO:
    """GSPO-style sequence-level clipped ratio: exp(mean(lp - lp_old)) per sequence."""

    def __init__(self, seqs, gen, old):
        self.adv = torch.randn(len(seqs), generator=gen, dtype=torch.float64)
        self.old = old
        self.calls = []

    def __call__(self, lps, index=None):
        idx = range(len(lps)) if index is None else index.tolist()
        self.calls.append(list(idx))
        total = 0
        for i, lp in zip(idx, lps):
            if len(lp) == 0:
                continue
            ratio = torch.exp((lp - self.old[i]).mean())
            a = self.adv[i]
            total = total - torch.minimum(ratio * a, ratio.clamp(0.97, 1.03) * a)
        return total / len(self.adv)


@pytest.mark.parametrize("mode", MODES)
def test_gspo_sequence_level_loss(mode, gen):
    seqs = shaped_forest(gen, SPEC)
    model = get_model("qwen2-tied-mqa")
    lps, _ = reference_logprobs(model, seqs)
    # per sequence: a log-ratio of about +-0.06 (clipped) or +-0.01 (not clipped), plus noise
    shift = [(0.06 if i % 2 else 0.01) * (1 if i % 4 < 2 else -1) for i in range(len(lps))]
    old = [lp.detach() - d + 0.01 * torch.randn(lp.shape, generator=gen, dtype=lp.dtype) for lp, d in zip(lps, shift)]
    loss = GSPO(seqs, gen, old)
    ratios = torch.stack([torch.exp((lp.detach() - o).mean()) for lp, o in zip(lps, old)])
    assert ((ratios < 0.97) | (ratios > 1.03)).any() and ((ratios > 0.97) & (ratios < 1.03)).any()  # clip matters
    for separable in (False, True):
        check_engine(model, seqs, mode, loss, separable=separable, **MODE_KW[mode])


@pytest.mark.parametrize("mode", MODES)
def test_gradients_accumulate(mode, gen):
    seqs = shaped_forest(gen, SPEC)
    model = get_model("qwen3")
    loss = RandomLoss.make(seqs, gen)
    _, ref, _, _ = reference_step(model, seqs, loss)
    engine = TreeEngine(model, mode, **MODE_KW[mode])
    # existing gradients are added to, never overwritten
    start = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = start[n].clone()
    engine.forward_backward(seqs, loss)
    assert_grads_close({n: g - start[n] for n, g in grads_of(model).items()}, ref, 1e-9, 1e-5)
    engine.forward_backward(seqs, loss, separable=True)
    assert_grads_close({n: g - start[n] for n, g in grads_of(model).items()}, {n: 2 * g for n, g in ref.items()}, 1e-9, 1e-5)
    zero_grads(model)


def test_forward_outputs_per_tree_token(gen):
    seqs = shaped_forest(gen, SPEC)
    tree = PrefixTree.from_sequences(seqs)
    model = get_model("qwen3")
    ref_lps, ref_ents = reference_logprobs(model, seqs)
    for mode in ("packed", "dfs", "auto"):
        out = TreeEngine(model, mode, **MODE_KW[mode]).forward(tree, entropy=True)
        assert out.logprob.shape == (tree.num_tree_tokens,) and out.logprob.dtype == torch.float64
        roots = tree.parent < 0
        assert (out.logprob[roots] == 0).all() and (out.entropy[roots] == 0).all()
        for i in range(len(seqs)):  # a shared tree token holds every sharing sequence's value
            assert_seq_close([out.logprob[tree.path(i)[1:]]], [ref_lps[i].detach()], 1e-9)
            assert_seq_close([out.entropy[tree.path(i)[1:]]], [ref_ents[i].detach()], 1e-9, "entropies")
        assert TreeEngine(model, mode, **MODE_KW[mode]).forward(tree).entropy is None
        assert out.logprob.requires_grad is False


def test_single_token_sequences_only():
    seqs = [[3], [7], [3], [60]]
    model = get_model("qwen3")
    for mode in MODES:
        engine = TreeEngine(model, mode, max_tokens=4, chunk_tokens=1)
        lps, ents = engine.logprobs(seqs, entropy=True)
        assert [len(x) for x in lps] == [0] * 4 and [len(x) for x in ents] == [0] * 4
        zero_grads(model)
        value = engine.forward_backward(seqs, lambda lps: sum(lp.sum() for lp in lps))
        assert value == 0.0
        assert all(p.grad is None or (p.grad == 0).all() for p in model.parameters())


# --------------------------------------------------------------- plan invariants
@settings(max_examples=200, **HYP)
@given(st.lists(st.integers(1, 60), max_size=12), st.integers(1, 80))
def test_balanced_groups_match_greedy_count_with_smaller_largest(sizes, cap):
    """Sibling subtrees batch into as many calls as greedy packing to the pack limit makes,
    in order, every group of several within the limit, the largest group no larger than
    greedy's (the step's memory peak) and as small as any split into that many groups."""
    from itertools import combinations

    from treerl.engine.plan import _balanced_groups, _greedy_groups

    greedy, balanced = _greedy_groups(sizes, cap), _balanced_groups(sizes, cap)
    assert len(balanced) == len(greedy)
    assert [i for a, b in balanced for i in range(a, b)] == list(range(len(sizes)))
    total = [sum(sizes[a:b]) for a, b in balanced]
    assert all(t <= cap for (a, b), t in zip(balanced, total) if b - a > 1)
    assert max(total, default=0) <= max((sum(sizes[a:b]) for a, b in greedy), default=0)
    if 0 < len(sizes) <= 8:  # the smallest largest group over every split into that many groups
        k = len(balanced)
        best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cut), (*cut, len(sizes))))
                   for cut in combinations(range(1, len(sizes)), k - 1))
        assert max(total) == best


@settings(max_examples=120, **HYP)
@given(
    forests(max_seqs=10, max_len=20),
    st.sampled_from(MODES),
    st.integers(1, 40),
    st.integers(1, 15),
    st.one_of(st.none(), st.integers(1, 40)),
)
def test_plan_invariants(seqs, mode, max_tokens, chunk, pack):
    tree = PrefixTree.from_sequences(seqs, share_prefixes=mode != "flat")
    if mode == "packed":
        max_tokens = max(max_tokens, max(tree_sizes(tree)))
    plan = make_plan(tree, mode, max_tokens, chunk, pack)
    n = tree.num_tree_tokens
    segs = plan.segments
    # Segments partition the layout, in order.
    assert [s.start for s in segs] == sorted(s.start for s in segs)
    assert sorted(t for s in segs for t in range(s.start, s.end)) == list(range(n))
    budget = chunk if mode == "dfs" else max_tokens
    assert all(0 < s.size <= budget for s in segs)
    # several trees share a call only up to pack tokens (a larger tree runs alone)
    roots = (tree.parent < 0).nonzero()[:, 0]
    for s in segs:
        if int(((roots >= s.start) & (roots < s.end)).sum()) > 1:
            assert s.size <= min(budget, pack or budget)
    if mode == "packed":
        assert plan.single_level
    else:
        assert plan.peak_live_tokens() <= budget
    if mode == "flat":  # chains exactly for the sequences longer than the budget
        assert plan.single_level == (max(tree_sizes(tree)) <= max_tokens)
        assert sum(map(bool, plan.children)) == sum(max(0, -(-size // max_tokens) - 1) for size in tree_sizes(tree))
    parent = tree.parent.tolist()
    for i, s in enumerate(segs):
        assert plan.children[i] == [j for j, c in enumerate(segs) if c.parent == i]
        prefix = [t for a in plan.ancestors(i) for t in range(segs[a].start, segs[a].end)]
        assert len(prefix) == plan.prefix_tokens(i)
        for q in range(s.start, s.end):
            anc, k = set(), parent[q]
            while k >= 0:
                anc.add(k)
                k = parent[k]
            # every ancestor of q is in the segment or its prefix; every prefix token is one
            assert set(prefix) <= anc
            assert anc <= set(prefix) | set(range(s.start, q))
        if s.retain:
            assert plan.children[i]
    # Targets: every non-root token exactly once, in the segment holding its parent.
    targets = torch.cat(plan.targets).tolist()
    assert sorted(targets) == [t for t in range(n) if parent[t] >= 0]
    for i, s in enumerate(segs):
        assert all(s.start <= parent[t] < s.end for t in plan.targets[i].tolist())


# ------------------------------------------------------------------ mask pitfalls
def _tree_token_reference(tree, seqs, model):
    ref = torch.full((tree.num_tree_tokens,), float("nan"), dtype=torch.float64)
    lps, _ = reference_logprobs(model, seqs)
    for i, lp in enumerate(lps):
        ref[tree.path(i)[1:]] = lp.detach()
    return ref


def _logprobs_from_packed_logits(tree, logits):
    logp = torch.log_softmax(logits[0].to(torch.float64), -1)
    child = (tree.parent >= 0).nonzero()[:, 0]
    out = torch.full((tree.num_tree_tokens,), float("nan"), dtype=torch.float64)
    out[child] = logp[tree.parent[child]].gather(1, tree.token_ids[child, None])[:, 0]
    return out


@pytest.mark.parametrize("variant", ["qwen3", "llama"])
def test_depth_positions_without_tree_mask_are_wrong(variant, gen):
    prompt = random_seq(gen, 6)
    seqs = [prompt + random_seq(gen, 7) for _ in range(4)] + [random_seq(gen, 5)]
    tree = PrefixTree.from_sequences(seqs)
    model = get_model(variant)
    ref = _tree_token_reference(tree, seqs, model)
    child = tree.parent >= 0
    ids, pos = tree.token_ids[None], tree.position[None]
    with torch.no_grad():
        # the packed layout with depth position ids through HF's own attention, no mask
        no_mask = _logprobs_from_packed_logits(tree, model(input_ids=ids, position_ids=pos).logits)
        # positive control: the same call with the tree mask as a 4-D boolean mask is right
        idx = torch.arange(tree.num_tree_tokens)
        mask = dense_tree_mask(idx, idx, tree.subtree_end)[None, None]
        masked = _logprobs_from_packed_logits(tree, model(input_ids=ids, position_ids=pos, attention_mask=mask).logits)
    assert (masked[child] - ref[child]).abs().max() < 1e-12
    assert (no_mask[child] - ref[child]).abs().max() > 1e-2, "without the tree mask the result should be wrong"
    engine_lp = TreeEngine(model, "packed").forward(tree).logprob
    assert (engine_lp[child] - ref[child]).abs().max() < 1e-12


def test_treerl_attention_refuses_to_run_without_tree_mask(gen):
    model = get_model("qwen3")
    tree = PrefixTree.from_sequences([random_seq(gen, 5) + [1, 2], random_seq(gen, 5)])
    ids, pos = tree.token_ids[None], tree.position[None]
    with pytest.raises(RuntimeError, match="without a tree mask"):
        with tree_attention_enabled(model):
            model(input_ids=ids, position_ids=pos)
    assert model.config._attn_implementation == "sdpa"  # restored after the error
    idx = torch.arange(tree.num_tree_tokens)
    ctx = TreeAttention("sdpa", idx, idx, tree.subtree_end)
    four_d = torch.ones(1, 1, len(idx), len(idx), dtype=torch.bool)
    with pytest.raises(RuntimeError, match="attention_mask too"):
        with tree_attention_enabled(model):
            model(input_ids=ids, position_ids=pos, attention_mask=four_d, tree_attention=ctx)
    assert model.config._attn_implementation == "sdpa"
    # and with the kwarg, the direct call is exact
    with torch.no_grad(), tree_attention_enabled(model):
        direct = _logprobs_from_packed_logits(tree, model(input_ids=ids, position_ids=pos, tree_attention=ctx).logits)
    ref = _tree_token_reference(tree, tree.sequences(), model)
    child = tree.parent >= 0
    assert (direct[child] - ref[child]).abs().max() < 1e-12


# --------------------------------------------- phase 1's last path reused by phase 2
@pytest.mark.parametrize("mode", ["auto", "dfs"])
def test_two_phase_reuses_the_forward_path_keys_values(mode, gen, monkeypatch):
    """Phase 1 ends on the leftmost path, the one phase 2 opens first: its recomputed
    chains take phase 1's K/V instead of a no-grad call each, exactly (and without it the
    same plan makes exactly those calls more)."""
    seqs = shaped_forest(gen, SPEC[:1])  # one tree: its leftmost path is where both phases meet
    model = get_model("qwen3")
    calls = {}
    for reuse in (True, False):
        monkeypatch.setattr(TreeEngine, "reuse_forward_kv", reuse)
        loss = RandomLoss.make(seqs, gen, coupled=True)
        engine = check_engine(model, seqs, mode, loss, max_tokens=13, chunk_tokens=4)
        calls[reuse] = engine.stats.model_calls
    plan = engine.plan(seqs)
    leftmost, i = [], 0  # the first tree's leftmost path: segment 0, its first child, ...
    while plan.children[i]:
        leftmost.append(i)
        i = plan.children[i][0]
    saved = sum(1 for i in leftmost if not plan.segments[i].retain)
    assert saved >= 1, plan.describe()
    assert calls[False] - calls[True] == saved


@pytest.mark.parametrize("mode", ["auto", "dfs"])
@pytest.mark.parametrize("entropy", [False, True])
def test_separable_loss_runs_chained_trees_in_one_pass(mode, entropy, gen):
    """A separable loss over chained trees takes no phase 1: each sequence's term right after
    the call holding its last token, so every call of the plan runs once (a recomputed chain
    twice: its no-grad call for the K/V, its recompute with grad) and the loss meets each
    sequence once, in as many calls as segments hold sequence ends, exactly. Sequences that are
    prefixes of others (an agent's earlier turns) end inside chains; a repeated one, and one of
    a single token (nothing to predict), end where their twin does."""
    from treerl.engine.batch import sequences_ending_in

    seqs = shaped_forest(gen, SPEC)
    longest = max(seqs, key=len)
    seqs += [longest[: len(longest) // 3], longest[: len(longest) // 2], longest[:2], list(seqs[1]), longest[:1]]
    model = get_model("qwen3")
    loss = RandomLoss.make(seqs, gen)
    engine = check_engine(model, seqs, mode, loss, max_tokens=13, chunk_tokens=4, entropy=entropy, separable=True)
    plan = engine.plan(seqs)
    assert any(plan.children), plan.describe()
    skipped = [i for i, s in enumerate(plan.segments) if not plan.children[i] and len(plan.targets[i]) == 0]
    assert engine.stats.model_calls == plan.num_calls - len(skipped)
    batch = engine._prepare(seqs)
    ends = sequences_ending_in(batch, set(range(len(plan.segments))))
    assert len(loss.calls) == len(ends) and sum(len(s) for s, _, _ in ends.values()) == len(seqs)
    assert any(plan.children[i] for i in ends)  # some sequences end inside a chain
    retained = {plan.segments[i].retain for i, c in enumerate(plan.children) if c}
    assert False in retained and (True in retained or mode == "dfs"), plan.describe()  # recomputed chains, retained


@pytest.mark.parametrize("prefix,queries", [(256, 45), (130, 300), (200, 200)])
def test_square_flex_mask_matches_the_tree_mask(prefix, queries, gen, monkeypatch):
    """``PREFIX_AS_TILES``'s square block mask (empty query tiles in front) gives the tree
    attention of a call after a prefix, as the dense mask does (flex forward, eager, CPU;
    its backward runs on CUDA: tests/cuda/test_cuda.py)."""
    import torch.nn.functional as F
    import warnings

    import treerl.engine.attention as attention

    monkeypatch.setattr(attention, "_FLEX_TILES", attention._flex_whole_tiles)  # eager flex: no CPU compile
    monkeypatch.setattr(attention, "_FLEX_ANY", attention._flex_any)
    seqs = [list(range(2, 300)) + [5, 6, 7], list(range(2, 300)) + [9] * 140, list(range(2, 200)) + [11] * 50]
    end = PrefixTree.from_sequences(seqs).subtree_end
    qi, ki = torch.arange(prefix, prefix + queries), torch.arange(prefix + queries)
    q = torch.randn(1, 4, queries, 16, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(1, 2, prefix + queries, 16, dtype=torch.float64, generator=gen) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_tree_mask(qi, ki, end[ki])[None, None],
                                         enable_gqa=True)
    mask = attention.flex_block_mask(qi, ki, end[ki], square=True)
    assert mask.seq_lengths[0] == mask.seq_lengths[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is not compiled
        out = attention.flex_tree_attention(q, k, v, mask, None)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
