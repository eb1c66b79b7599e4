"""The engine-vs-reference check of the exactness tests: :func:`check_engine` runs a
:class:`TreeEngine` on a forest and compares logprobs, entropies, the loss and every
parameter's gradient with the per-sequence reference; :data:`SPEC`, a forest topology that
exercises every mode."""

from __future__ import annotations

import pytest
import torch

from helpers.reference import FLOOR, TOL, assert_grads_close, assert_seq_close, grads_of, reference_step, zero_grads
from treerl import PrefixTree, TreeEngine

MODES = ("flat", "packed", "dfs", "auto")

# A forest with a fixed topology (random tokens): three trees, a 12-token node, fans,
# a sequence ending at an inner node, 1-token nodes. 61 tree tokens, 127 flat tokens.
SPEC = [
    (6, [
        (3, [(4, []), (5, []), (2, [(3, []), (3, [])])]),
        (8, []),
        (2, [], True),
        (1, [(1, []), (1, [])]),
    ]),
    (5, []),
    (12, [(2, []), (3, [])]),
]


def plan_features(plan) -> dict[str, int]:
    chains = [i for i, c in enumerate(plan.children) if c]
    return dict(
        segments=len(plan.segments),
        chains=len(chains),
        recomputed=sum(1 for i in chains if not plan.segments[i].retain),
        retained=sum(1 for i in chains if plan.segments[i].retain),
        with_prefix=sum(1 for s in plan.segments if s.parent >= 0),
    )


def check_engine(
    model,
    seqs,
    mode,
    loss,
    *,
    max_tokens=8192,
    chunk_tokens=2048,
    entropy=False,
    separable=False,
    temperature=1.0,
    tree_input="list",
    logits_chunk_elements=None,
    memory_budget=None,
):
    """Engine logprobs/entropies/loss/gradients vs the per-sequence reference.
    With ``memory_budget``, the engine plans by it (``max_tokens`` unused)."""
    dtype = next(model.parameters()).dtype
    tol, floor = TOL[dtype], FLOOR[dtype]
    loss_dtype = getattr(loss, "dtype", None)
    if loss_dtype is not None:
        loss.dtype = None  # the reference hands float64 log-softmax values to the loss
    ref_loss, ref_grads, ref_lps, ref_ents = reference_step(
        model, seqs, loss, entropy=entropy, temperature=temperature
    )
    if loss_dtype is not None:
        loss.dtype = loss_dtype  # the engine: float32, or float64 for a float64 model
    extra = {} if logits_chunk_elements is None else dict(logits_chunk_elements=logits_chunk_elements)
    if memory_budget is not None:
        extra.update(memory_budget=memory_budget)
        max_tokens = None
    engine = TreeEngine(model, mode, max_tokens=max_tokens, chunk_tokens=chunk_tokens, temperature=temperature, **extra)
    given_tree = {
        "list": lambda: seqs,
        "tensors": lambda: [torch.tensor(s) for s in seqs],
        "tree": lambda: PrefixTree.from_sequences(seqs),
        "unshared_tree": lambda: PrefixTree.from_sequences(seqs, share_prefixes=False),
    }[tree_input]()

    lps, ents = engine.logprobs(given_tree, entropy=True)
    assert_seq_close(lps, ref_lps, tol, "logprobs")
    assert_seq_close(ents, ref_ents, tol, "entropies")
    n_tree = (PrefixTree.from_sequences(seqs, share_prefixes=mode != "flat" and tree_input != "unshared_tree")).num_tree_tokens
    assert 0 < engine.stats.tokens_run <= n_tree or all(len(s) == 1 for s in seqs), engine.stats
    lps_only = engine.logprobs(given_tree)
    assert all(torch.equal(a, b) for a, b in zip(lps_only, lps))

    zero_grads(model)
    token_wise = hasattr(loss, "token_loss")
    (loss.seen if token_wise else loss.calls).clear()
    value = engine.forward_backward(given_tree, loss, entropy=entropy, separable=separable)
    if token_wise:  # each token reaches the loss exactly once (the fused head asks per logits chunk)
        seen = torch.cat(loss.seen).sort().values if loss.seen else torch.zeros(0, dtype=torch.long)
        assert seen.tolist() == list(range(sum(len(s) - 1 for s in seqs))), loss.seen
    else:  # each sequence reaches the loss exactly once; non-separable losses see all at once
        seen = sorted(i for call in loss.calls for i in call)
        assert seen == list(range(len(seqs))), loss.calls
        if not separable:
            assert len(loss.calls) == 1
    # the loss is a sum of terms that cancel: its error scales with the terms' size
    scale = 1 + sum(float(x.abs().sum()) for x in ref_lps + (ref_ents if entropy else []))
    assert value == pytest.approx(ref_loss, rel=tol, abs=tol * scale)
    if sum(len(s) - 1 for s in seqs) == 0:  # nothing predicted: no gradient at all
        assert all(g.abs().max() == 0 for g in grads_of(model).values())
    else:
        assert_grads_close(grads_of(model), ref_grads, tol, floor)
    assert model.config._attn_implementation == "sdpa", "engine left the model switched to treerl attention"
    zero_grads(model)
    return engine


def general_peak(plan, kept, model) -> float:
    """The general path's live bytes at their highest, walked independently: each held
    call's peak plus the attentions it keeps (at most its spare bytes, which is all the
    engine lets them take), after the graphs held before it (with their kept attentions)
    and the keys/values phase 1 leaves for phase 2 (one chained path at most)."""
    from treerl.engine.two_phase import held_bytes

    reused = model.kv_per_token * max((plan.prefix_tokens(i) + s.size for i, s in enumerate(plan.segments)
                                       if plan.children[i]), default=0)
    held, peak = reused, reused
    for i in sorted(kept):
        s = kept[i]
        attention = s.spare if s.recompute else 0.0
        peak = max(peak, held + model.call_bytes(s.size, 0, s.recompute) + attention)
        held += held_bytes(model, s.size, s.recompute) + attention
    return peak
