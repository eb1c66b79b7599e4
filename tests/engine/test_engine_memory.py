"""Planning by a memory budget, and decoder blocks recomputed in the backward.

Every mode under a budget small enough that calls recompute their blocks (and, for
``auto``/``dfs``, that trees split into chains) stays exact against the per-sequence
reference: float64 to 1e-9, float32 to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from helpers.engine import MODES, SPEC, check_engine, general_peak
from helpers.forests import RandomLoss, shaped_forest
from helpers.models import VARIANTS, get_model
from treerl import PrefixTree, TreeEngine
from treerl.engine.memory import BACKWARD_MARGIN, CallBudget, MemoryModel, MemoryPolicy, resolve_budget
from treerl.engine.two_phase import keep_graphs


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
    assert engine.memory.recomputes(7) and not engine.memory.recomputes(6)
    assert engine.memory.max_tokens >= 39  # every tree (and sequence) fits one call with recompute
    loss = RandomLoss.make(seqs, gen, coupled=True, one_sign=dtype == torch.float32)
    engine = check_engine(model, seqs, mode, loss, entropy=True, chunk_tokens=chunk, memory_budget=budget)
    assert engine.stats.recomputed_calls >= 1, engine.stats


@pytest.mark.parametrize("separable", [False, True])
@pytest.mark.parametrize("keep_all", [False, True], ids=["", "every-attention-kept"])
def test_budget_splits_trees_with_recomputed_chains(separable, keep_all, gen, monkeypatch):
    """With ``keep_all`` every recomputed call keeps every layer's attention, whatever the
    budget: chained calls attend over their prefix (concatenated K/V) exactly too."""
    if keep_all:
        monkeypatch.setattr(MemoryPolicy, "kept_attention_layers",
                            lambda self, queries, keys, copies, spare, **kw: frozenset(range(self.layers)))
    seqs = shaped_forest(gen, SPEC)
    tree = PrefixTree.from_sequences(seqs)
    model = get_model("qwen3", num_hidden_layers=16)
    m = MemoryModel.estimate(model.config, torch.float64, dense_mask=True)
    # with recompute, calls of up to 13 tokens fit (the 39-token tree splits into chains);
    # without, only ~2 (so every call over that recomputes)
    budget = int(m.fixed + 13 * m.recompute_per_token + 13**2 * m.per_pair) + 1
    engine = TreeEngine(model, "auto", memory_budget=budget, chunk_tokens=4)
    assert engine.memory.max_tokens == 13 and engine.memory.recomputes(4)
    plan = engine.plan(tree)
    assert any(plan.children) and max(s.size for s in plan.segments) <= 13
    loss = RandomLoss.make(seqs, gen)
    engine = check_engine(model, seqs, "auto", loss, chunk_tokens=4, memory_budget=budget, separable=separable)
    assert engine.stats.recomputed_calls >= 1
    if keep_all:
        assert engine.stats.kept_attention_layers == 16 * engine.stats.recomputed_calls


@pytest.mark.parametrize("separable", [False, True])
def test_only_lone_calls_without_prefix_take_the_margin(separable, gen, monkeypatch):
    """Kept attentions may take the memory model's margin only in a call whose backward runs
    right after its forward with nothing else held (``alone``): the standalone trees of a
    separable loss; never a chained call (after a prefix, or held until a chain closes) nor
    the general path's calls (graphs held until the loss)."""
    calls = []  # (alone, queries, keys) per recomputing call
    original = MemoryPolicy.kept_attention_layers

    def spy(self, queries, keys, copies, spare, alone=False, roots=()):
        calls.append((alone, queries, keys))
        return original(self, queries, keys, copies, spare, alone=alone, roots=roots)

    monkeypatch.setattr(MemoryPolicy, "kept_attention_layers", spy)
    seqs = shaped_forest(gen, SPEC)
    model = get_model("qwen3", num_hidden_layers=16)
    m = MemoryModel.estimate(model.config, torch.float64, dense_mask=True)
    budget = int(m.fixed + 13 * m.recompute_per_token + 13**2 * m.per_pair) + 1  # as above: chains, recompute
    engine = TreeEngine(model, "auto", memory_budget=budget, chunk_tokens=4)
    plan = engine.plan(PrefixTree.from_sequences(seqs))
    chained = plan.chained_segments()
    standalone = [s for i, s in enumerate(plan.segments) if i not in chained and engine.memory.recomputes(s.size)]
    assert chained and standalone  # both kinds in one batch
    check_engine(model, seqs, "auto", RandomLoss.make(seqs, gen), chunk_tokens=4, memory_budget=budget,
                 separable=separable)
    assert calls and all(keys == queries for alone, queries, keys in calls if alone)
    assert any(keys > queries for _, queries, keys in calls)  # chained calls ran (and none was alone)
    if separable:
        assert sum(alone for alone, _, _ in calls) >= len(standalone), calls
    else:
        assert not any(alone for alone, _, _ in calls), calls


@pytest.mark.parametrize("mode", ["auto", "flat"])
def test_recomputed_blocks_keep_attention_within_the_budget(mode, gen, monkeypatch):
    """Room in the budget beside a recomputed call goes to keeping the attention of its
    last layers: their recompute in the backward skips the attention, and their
    attention's backward reads the recomputed query/key/value, exactly."""
    import treerl.engine.attention as attention

    seqs = shaped_forest(gen, SPEC)
    model = get_model("qwen3", torch.float64, num_hidden_layers=16)
    m = MemoryModel.estimate(model.config, torch.float64, dense_mask=True)
    largest = 39  # shaped_forest(SPEC)'s largest tree: one call with recompute
    held = m.fixed + largest * m.recompute_per_token + largest**2 * m.per_pair
    per_layer = (largest * (m.attention_per_query + m.attention_copies_per_query + m.attention_copies_per_key)
                 + largest**2 * m.attention_per_pair)  # SDPA's inputs are copies
    budget = int(held + 5.5 * per_layer)  # 5 of 16 layers keep their attention in a 39-token call
    spare = budget - m.call_bytes(largest, recompute=True)
    assert m.kept_attention_layers(spare, largest, largest, 16, copies=True) == 5
    engine = TreeEngine(model, mode, memory_budget=budget, chunk_tokens=4)
    assert engine.memory.kept_attention_layers(largest, largest, copies=True, spare=spare) == frozenset(range(11, 16))
    assert engine.memory.recomputes(largest) and engine.memory.max_tokens >= largest
    attends = {}  # per call (its TreeAttention, held): layers kept, attention runs
    attend = attention._attend

    def spy(ctx, *args, **kwargs):
        attends[ctx] = (len(ctx.keep_layers), attends.get(ctx, (0, 0))[1] + 1)
        return attend(ctx, *args, **kwargs)

    monkeypatch.setattr(attention, "_attend", spy)
    # (separable: each call's kept attentions as the plan sizes them; a non-separable loss holds
    # several calls' graphs at once and shares the spare bytes among them, test_engine_exact.py)
    loss = RandomLoss.make(seqs, gen)
    engine = check_engine(model, seqs, mode, loss, entropy=True, chunk_tokens=4, memory_budget=budget, separable=True)
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


def test_kept_group_attention_counts_its_own_part(monkeypatch):
    """With groups after a prefix on (or "cuda", the default: counted on any device), a kept
    attention after a prefix holds its own part's output and LSE besides the merged ones:
    twice the bytes per query; without a prefix, or with the switch off, as before."""
    from treerl.engine import attention

    m = MemoryModel.estimate(get_model("qwen3").config, torch.float32)
    for copies in (False, True):
        monkeypatch.setattr(attention, "GROUPS_AFTER_PREFIX", False)
        off, plain = m._kept_layer_bytes(copies, prefix=True), m._kept_layer_bytes(copies, prefix=False)
        monkeypatch.setattr(attention, "GROUPS_AFTER_PREFIX", True)
        on = m._kept_layer_bytes(copies, prefix=True)
        assert on[0] == off[0] + m.attention_per_query and on[1:] == off[1:]
        assert m._kept_layer_bytes(copies, prefix=False) == plain
        monkeypatch.setattr(attention, "GROUPS_AFTER_PREFIX", "cuda")
        assert m._kept_layer_bytes(copies, prefix=True) == on


@pytest.mark.parametrize("bad", [0, -5, 1.5, 4096, float("nan"), "8GB", True])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        resolve_budget(bad, torch.device("cpu"))


def test_budget_forms():
    cpu = torch.device("cpu")
    assert resolve_budget(8 << 30, cpu) == 8 << 30
    assert resolve_budget(float(8 << 30), cpu) == 8 << 30  # YAML/CLI floats: bytes above 1
    assert resolve_budget(0.5, cpu) > resolve_budget(0.1, cpu) > 0
    assert resolve_budget(None, cpu) == resolve_budget(0.25, cpu)
    model = get_model("qwen3")
    assert TreeEngine(model, max_tokens=77).memory.max_tokens == 77  # the override: no budget
    assert not TreeEngine(model, max_tokens=77).memory.recomputes(10**6)


def test_single_chain_segments_run_plain_causal_attention(gen, monkeypatch):
    """A segment that is one chain without prefix (flat's long sequences, a lone path)
    runs SDPA's causal kernel with no mask tensor, exactly."""
    import treerl.engine.attention as attention

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



def test_separable_mixed_plan_runs_whole_trees_once(gen, monkeypatch):
    """A plan where one tree splits into chains and the others fit a call: with a separable
    loss every tree runs forward+backward once (no two-phase extra forward), exactly.
    (Phase 1's path reuse off: which chain it saves differs between the two.)"""
    monkeypatch.setattr(TreeEngine, "reuse_forward_kv", False)
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
    # non-separable: the standalone trees whose graph the budget cannot hold until the loss
    # (5 + 17 tokens > 20) pay phase 1's extra forward; the one held does not; and the chained
    # tree's phase 1, which a separable loss does not take (one pass)
    kept = keep_graphs(plan, CallBudget.tokens_only(20))
    assert 0 < len(kept) < len(standalone)
    phase_one = sum(s.size for i, s in enumerate(plan.segments)
                    if i in plan.chained_segments() and (plan.children[i] or len(plan.targets[i])))
    assert runs[False] - runs[True] == phase_one + sum(
        s.size for i, s in enumerate(plan.segments) if s in standalone and i not in kept)


# ------------------------------------------------------------- long trees in bytes
def simulated_peak(plan, model: MemoryModel, layers: int, copies: bool) -> float:
    """The executor's live activation bytes at their highest, walked as the two-phase
    backward runs (independently of the planner's bookkeeping): the open chain segments'
    keys/values leaves with gradients and retained graphs, plus the call running now (its
    kept attentions as the engine picks them from the segment's spare bytes)."""
    peak, path = 0.0, []  # path: (segment, bytes it holds while its children run)

    def call(i: int) -> float:
        s, prefix = plan.segments[i], plan.prefix_tokens(i)
        chain = bool(plan.children[i])
        total = model.call_bytes(s.size, prefix, s.recompute, leaves=chain)
        if s.recompute:
            kept = model.kept_attention_layers(s.spare, s.size, s.size + prefix, layers, copies or bool(prefix))
            per_query, per_key, per_pair = model._kept_layer_bytes(copies or bool(prefix))
            total += kept * (s.size * per_query + (s.size + prefix) * (per_key + s.size * per_pair))
        return total

    def live() -> float:
        return sum(h for _, h in path)

    for i, s in enumerate(plan.segments):
        while path and path[-1][0] != s.parent:
            j, _ = path.pop()
            peak = max(peak, live() + call(j))  # its backward (recomputed, or its retained graph)
        if plan.children[i]:
            own = s.size * model.leaf_per_token
            if s.retain:
                own += model.call_bytes(s.size, plan.prefix_tokens(i)) - model.fixed
            path.append((i, own))
        else:
            peak = max(peak, live() + call(i))
    while path:
        j, _ = path.pop()
        peak = max(peak, live() + call(j))
    return peak


def h100_like(layers: int | None = None) -> tuple[MemoryModel, object]:
    """The Qwen3-1.7B shape's memory model as the H100 measured it (2.56 MB per token held,
    0.40 MB recomputed, bench/RESULTS.md), with the analytic terms of the estimate."""
    from transformers import Qwen3Config

    from treerl.engine.memory import attention_held, keys_values, weight_gradient_transients
    from treerl.models import SHAPES

    config = Qwen3Config(**SHAPES["qwen3-1.7b"])
    m = MemoryModel(fixed=3 * (1 << 27) * 4 + weight_gradient_transients(config, 2), per_token=2.56e6,
                    recompute_per_token=0.40e6, measured=True, **attention_held(config, torch.bfloat16, False),
                    **keys_values(config, torch.bfloat16))
    return m, config


@pytest.mark.parametrize("workload", ["long_prefix", "episodes", "long", "agentic", "tree"])
@pytest.mark.parametrize("mode", ["auto", "dfs"])
def test_plans_of_long_trees_stay_within_the_budget(workload, mode):
    """The 32k-token prefix and the 12-turn episodes at the Qwen3-1.7B shape, planned under
    the default budget of an 80 GB H100 (which ran out of memory before: retained chain
    pieces held 5 GB each, counted as tokens of recomputed calls): the executor's modelled
    peak stays within the budget, and equals the plan's own figure."""
    from treerl.engine.memory import CallBudget
    from treerl.engine.plan import make_plan
    from treerl.devtools.workloads import SCALES, make_workload

    m, config = h100_like()
    device = 85_029_158_912  # an H100 80GB's total_memory
    budget = CallBudget(m, 0.2 * device, recompute=True, device_bytes=device)
    tree = PrefixTree.from_sequences(make_workload(workload, SCALES["paper"], config.vocab_size))
    plan = make_plan(tree, mode, budget.tokens(), 2048, budget.pack(), memory=budget)
    peak = simulated_peak(plan, m, config.num_hidden_layers, copies=False)
    assert peak <= budget.budget, plan.describe()
    assert plan.peak_bytes <= budget.budget
    if workload == "long_prefix":
        assert any(plan.children) and any(s.recompute for s in plan.segments)
        # every call after a long prefix leaves the room its ancestors' keys/values take
        for i, s in enumerate(plan.segments):
            assert budget.room(plan.prefix_tokens(i)) >= m.call_bytes(s.size, plan.prefix_tokens(i), s.recompute,
                                                                      leaves=bool(plan.children[i]))


def test_a_path_too_long_for_the_budget_is_refused_with_what_it_needs(gen):
    """A budget that cannot hold even depth-first the longest path's keys/values: one error
    naming the path's length and the bytes it needs; a budget of those bytes runs it."""
    from treerl.engine.plan import TreeTooLargeError

    model = get_model("qwen3", num_hidden_layers=4)
    prompt = torch.randint(1, 60, (40,), generator=gen).tolist()
    seqs = [prompt + torch.randint(1, 60, (n,), generator=gen).tolist() for n in (3, 9)] + [[5, 6, 7]]
    engine = TreeEngine(model, "auto", memory_budget=1 << 20, chunk_tokens=8)
    need, _ = engine.memory.call_budget.path_needs(49)
    engine.memory.budget = int(need) - 1
    with pytest.raises(TreeTooLargeError, match=r"sequence 1 has a root-to-leaf path of 49 tokens .* GiB"):
        engine.plan(seqs)
    engine.memory.budget = int(need) + 1
    plan = engine.plan(seqs)
    assert any(plan.children) and plan.peak_bytes <= engine.memory.budget
    loss = RandomLoss.make(seqs, gen, coupled=True)
    check_engine(model, seqs, "auto", loss, entropy=True, chunk_tokens=8, memory_budget=int(need) + 1)


@pytest.mark.parametrize("mode", ["auto", "dfs"])
@pytest.mark.parametrize("slack", [1.0, 1.3, 2.0])
def test_tight_budgets_on_a_long_prefix_are_exact(mode, slack, gen):
    """Budgets from just above what the longest path needs: chains split by the room left
    under their prefix, calls recomputing their blocks and keeping attentions by bytes;
    exact against the per-sequence reference, and the modelled peak within the budget."""
    model = get_model("qwen3", num_hidden_layers=4)
    prompt = torch.randint(1, 60, (30,), generator=gen).tolist()
    seqs = [prompt + torch.randint(1, 60, (n,), generator=gen).tolist() for n in (4, 7, 2)]
    seqs += [seqs[1] + torch.randint(1, 60, (5,), generator=gen).tolist(), [9, 8, 7, 6]]
    probe = TreeEngine(model, mode, memory_budget=1 << 20, chunk_tokens=6)
    m = probe.memory.model
    budget = int(m.fixed + (probe.memory.call_budget.path_needs(max(map(len, seqs)))[0] - m.fixed) * slack) + 1
    probe.memory.budget = budget
    plan = probe.plan(seqs)
    assert simulated_peak(plan, m, 4, copies=True) <= budget
    assert any(plan.children)
    for separable in (False, True):
        loss = RandomLoss.make(seqs, gen, coupled=not separable)
        check_engine(model, seqs, mode, loss, entropy=not separable, chunk_tokens=6, memory_budget=budget,
                     separable=separable)


@pytest.mark.parametrize("workload", ["grpo", "agentic", "long"])
def test_general_path_holds_every_medium_call_at_the_default_budget(workload):
    """A loss that is not separable, on the medium batches at the Qwen3-1.7B shape and the
    H100's default budget: every call holds its graph until the loss (GRPO's two calls of
    ~25k tokens regrouped into smaller ones for it), so none pays phase 1's extra forward,
    and the held graphs stay within the budget (walked independently)."""
    import dataclasses

    from treerl.engine import two_phase
    from treerl.engine.plan import make_plan
    from treerl.devtools.workloads import SCALES, make_workload

    m, config = h100_like()
    device = 85_029_158_912
    budget = CallBudget(m, 0.2 * device, recompute=True, device_bytes=device)
    tree = PrefixTree.from_sequences(make_workload(workload, SCALES["paper"], config.vocab_size))
    plan = make_plan(tree, "auto", budget.tokens(), 2048, budget.pack(), memory=budget)
    cap = two_phase.pack_for_keeping(plan, budget, 2048)
    if len(two_phase.keep_graphs(plan, budget)) < len(two_phase.standalone_segments(plan)):
        assert workload == "grpo" and cap is not None
        plan = make_plan(tree, "auto", budget.tokens(), 2048, cap, memory=dataclasses.replace(budget, pack_cap=cap))
    kept = two_phase.keep_graphs(plan, budget)
    assert len(kept) == len(two_phase.standalone_segments(plan)) == len(plan.segments) > 1
    assert general_peak(plan, kept, m) <= budget.budget


def test_kept_attentions_of_a_call_alone_take_the_measured_models_margin():
    """A recomputing call without prefix whose backward follows its forward alone may keep more
    attentions: the measured model's margin for the call (BACKWARD_MARGIN's surplus on its
    recompute bytes) is added to its spare bytes; never after a prefix, never for a held graph, and an estimated
    model has no margin to give."""
    import dataclasses

    model = get_model("qwen3")
    engine = TreeEngine(model)
    policy = engine.memory
    estimate = policy.model
    assert estimate.recompute_margin(1000) == 0.0
    measured = dataclasses.replace(estimate, measured=True, attention_per_pair=0.0)  # (flex: no dense pairs)
    policy._model = measured
    n = 4096
    margin = measured.recompute_margin(n)
    assert margin == pytest.approx(n * measured.recompute_per_token * (1 - 1 / BACKWARD_MARGIN)) and margin > 0
    per_query, per_key, per_pair = measured._kept_layer_bytes(False)
    per_layer = n * per_query + n * per_key + n * n * per_pair
    spare = 0.5 * per_layer
    assert len(policy.kept_attention_layers(n, n, False, spare)) == 0
    alone = policy.kept_attention_layers(n, n, False, spare, alone=True)
    assert len(alone) == min(policy.layers, int((spare + margin) // per_layer)) > 0
    assert alone == frozenset(range(policy.layers - len(alone), policy.layers))  # the last layers
    assert len(policy.kept_attention_layers(n, n + 100, False, spare, alone=True)) == len(
        policy.kept_attention_layers(n, n + 100, False, spare))  # after a prefix: no margin
