"""The two-phase executor, and the general path: a loss not declared separable.

A loss that is not a sum over sequences (``TreeEngine.forward_backward(separable=False)``)
needs every sequence's logprobs before any gradient exists. Two phases (DESIGN.md, "Loss
semantics"): phase 1 computes every tree token's logprob (and entropy); the loss runs on
leaf copies of the per-sequence tensors, giving dL/dlogp; phase 2 injects those into the
backward of each segment. Chained trees (segments after a prefix) run phase 1
without grad and phase 2 as a recomputing call (:meth:`TreeEngine._grad_pass`); under a
separable loss they take one pass instead (:mod:`.one_pass`).

**Cost model of the general path.** A segment without prefix or children (a whole tree or
a group of trees) can instead run phase 1 *with grad* and hold its graph until the loss:
it then costs what it costs under a separable loss (forward, [block recompute,] backward),
while a segment whose graph is not held costs one more forward (the no-grad one of phase
1): +25-33% of its time. Held graphs cost memory until their backward, so they are
chosen within the engine's budget (:func:`keep_graphs`):

- every segment as planned, when the graphs of all of them fit (the separable cost);
- otherwise (with block recompute) every held call recomputes its blocks — a recomputing
  call holds only its blocks' inputs (:func:`held_bytes`, ~0.25 MB a token at the
  Qwen3-1.7B shape against 2.6 MB) — and, where the plan's calls are too large for all of
  them to be held, the trees are regrouped into smaller calls (:func:`pack_for_keeping`);
- what still does not fit runs two-phase (the extra forward).

Order (each step within the budget): phase 1 without grad (chained trees and the segments
not held; the chained trees leave their last path's keys/values for phase 2), then the
held segments' forwards with grad; the loss; the held segments' backwards (last first,
each freeing its graph); then phase 2 of the rest, with nothing held any more.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import torch

from .batch import Batch, outputs_and_grads, upload_indices
from .checks import check_loss
from .memory import BACKWARD_MARGIN, CallBudget, MemoryModel
from .plan import Plan, Segment, make_plan

if TYPE_CHECKING:
    from .tree_engine import TreeEngine

LossFn = Callable[..., torch.Tensor]


# --------------------------------------------------------------- held graphs, in bytes
def held_bytes(model: MemoryModel, size: int, recompute: bool) -> float:
    """Bytes a call of ``size`` tokens without prefix holds from its forward with grad to
    its backward: its whole call less the fixed transients without block recompute; with
    it, the blocks' inputs (the recomputing call's bytes less the one block's activations
    and gradients that only its backward adds, ``2 x per_token / layers``)."""
    if not recompute:
        return model.call_bytes(size) - model.fixed
    per_token = model.recompute_per_token - 2 * model.per_token / (model.layers * BACKWARD_MARGIN)
    return size * (per_token if per_token > 0 else model.recompute_per_token)


def standalone_segments(plan: Plan) -> list[int]:
    """Segments without prefix or children that predict something (whole trees, or groups of them)."""
    chained = plan.chained_segments()
    return [i for i in range(len(plan.segments)) if i not in chained and len(plan.targets[i])]


def _reused_path_bytes(plan: Plan, model: MemoryModel, chained: set[int]) -> float:
    """At most what phase 1 of the chained trees leaves for phase 2: one path's keys/values
    (no gradients), alive until phase 2 opens it."""
    return model.kv_per_token * max(
        (plan.prefix_tokens(i) + plan.segments[i].size for i in chained if plan.children[i]), default=0)


def forward_saved(plan: Plan, kept: dict) -> int:
    """Tokens of forward that holding the graphs of ``kept`` (index -> recompute first) saves:
    each held call's phase-1 forward, less a recompute forward where holding it adds one
    the plan did not have (then it costs what two phases cost)."""
    recomputes = {i: (k.recompute if isinstance(k, Segment) else k[0]) for i, k in kept.items()}
    return sum(plan.segments[i].size for i, r in recomputes.items() if not (r and not plan.segments[i].recompute))


def keep_graphs(plan: Plan, budget: CallBudget) -> dict[int, Segment]:
    """The standalone segments (no prefix, no children) whose phase 1 runs with grad and
    holds its graph until the loss, as they run then (``recompute`` and ``spare`` set):
    each held call's peak plus the graphs held before it fit the budget, beside the
    keys/values phase 1 leaves for phase 2. Every one as planned if all fit; otherwise,
    with block recompute, all recomputing, in layout order while they fit."""
    model = budget.model
    room = budget.budget - _reused_path_bytes(plan, model, plan.chained_segments())
    standalone = standalone_segments(plan)

    def greedy(recompute: bool | None) -> dict[int, tuple[bool, float]]:
        kept, held = {}, 0.0  # index -> (recompute, slack)
        for i in standalone:
            s = plan.segments[i]
            r = s.recompute if recompute is None else recompute
            slack = room - held - model.call_bytes(s.size, 0, r)
            if slack >= 0:
                kept[i] = (r, slack)
                held += held_bytes(model, s.size, r)
        return kept

    kept = greedy(None)
    if len(kept) < len(standalone) and budget.recompute:
        recomputing = greedy(True)
        if forward_saved(plan, recomputing) > forward_saved(plan, kept):
            kept = recomputing
    # Kept attentions: a held call's spare bytes stay held until its backward, so they come
    # out of every later held call's slack too.
    order = sorted(kept)
    floor, spares = float("inf"), {}
    for i in reversed(order):
        floor = min(floor, kept[i][1])
        spares[i] = floor
    used, out = 0.0, {}
    for i in order:
        size = plan.segments[i].size
        # at most what keeping every layer's attention takes (the engine keeps the layers
        # whose bytes fit the spare it gets, whatever its kernel copies)
        copies = (model.attention_copies_per_query + model.attention_copies_per_key) if budget.copies else 0.0
        every_layer = model.layers * size * (model.attention_per_query + copies + size * model.attention_per_pair)
        spare = min(max(0.0, spares[i] - used), every_layer) if kept[i][0] else 0.0
        used += spare
        out[i] = dataclasses.replace(plan.segments[i], recompute=kept[i][0], spare=spare)
    return out


def pack_for_keeping(plan: Plan, budget: CallBudget, min_tokens: int) -> int | None:
    """Most tokens per standalone call for which every standalone call can hold its graph
    while recomputing its blocks (the last held call's peak after all the others' graphs),
    or None where regrouping cannot help (no block recompute, calls already that small, or
    a bound under ``min_tokens``: calls too small to be worth the launches)."""
    if not budget.recompute:
        return None
    model = budget.model
    sizes = [plan.segments[i].size for i in standalone_segments(plan)]
    total = sum(sizes)
    per_held = held_bytes(model, 1, True)
    per_call = model.recompute_per_token - per_held
    room = budget.budget - _reused_path_bytes(plan, model, plan.chained_segments()) - model.fixed - per_held * total
    if per_call <= 0 or room <= 0:
        return None
    cap = int(room // per_call)
    return cap if min_tokens <= cap < max(sizes, default=0) else None


def general_plan(engine: "TreeEngine", b: Batch) -> tuple[Batch, dict[int, Segment]]:
    """The batch regrouped by :func:`pack_for_keeping` where the engine's plan has
    standalone calls too large for all of them to hold their graphs (and regrouping helps),
    and the segments whose graphs are held (:func:`keep_graphs` of the plan returned)."""
    budget = engine.memory.call_budget
    if budget is None:
        return b, keep_graphs(b.plan, CallBudget.tokens_only(b.plan.budget))
    kept = keep_graphs(b.plan, budget)
    if b.plan.single_level and len(b.plan.segments) == 1 or len(kept) == len(standalone_segments(b.plan)):
        return b, kept
    cap = pack_for_keeping(b.plan, budget, engine.chunk_tokens)
    if cap is None:
        return b, kept
    plan = make_plan(b.tree, engine.mode, engine.memory.max_tokens, engine.chunk_tokens, cap,
                     memory=dataclasses.replace(budget, pack_cap=cap))
    regrouped = keep_graphs(plan, budget)
    if forward_saved(plan, regrouped) <= forward_saved(b.plan, kept):
        return b, kept  # (smaller calls that need no recompute: holding them saves nothing)
    engine.stats.plan = plan.describe()
    return dataclasses.replace(b, plan=plan, targets=upload_indices(plan.targets, engine.device)), regrouped


# --------------------------------------------------------------------- the executor
def loss_gradients(b: Batch, lp_all: torch.Tensor, ent_all: torch.Tensor | None, loss_fn: LossFn,
                   separable: bool, seqs: torch.Tensor, targets: torch.Tensor, lengths: list[int],
                   into: tuple[torch.Tensor, torch.Tensor | None] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The loss on leaf copies of the per-sequence tensors of ``seqs`` (tree tokens
    ``targets``, ``lengths`` L-1 each), and dL/dlogprob (dL/dentropy) summed per tree token [N]
    (added to the buffers ``into`` where given, and those returned)."""
    leaves = [lp_all[targets].requires_grad_()]
    if ent_all is not None:
        leaves.append(ent_all[targets].requires_grad_())
    outs = [list(leaf.split(lengths)) for leaf in leaves]
    loss = loss_fn(*outs, index=seqs) if separable else loss_fn(*outs)
    check_loss(loss)
    loss.backward()
    grads = []
    for k, (leaf, buf) in enumerate(zip(leaves, (lp_all, ent_all))):
        g = torch.zeros_like(buf) if into is None else into[k]
        if leaf.grad is not None:
            g.index_add_(0, targets, leaf.grad)
        grads.append(g)
    return loss.detach(), grads[0], grads[1] if ent_all is not None else None


def forward_backward(engine: "TreeEngine", b: Batch, loss_fn: LossFn, entropy: bool, separable: bool) -> float:
    """Two phases over every segment — the general path — holding the graphs of the
    standalone segments that fit (:func:`keep_graphs`)."""
    kept: dict[int, Segment] = {}
    if not engine.runner.stack.sharded:  # (FSDP-sharded blocks: one forward per backward)
        b, kept = general_plan(engine, b)
        segments = [kept.get(i, s) for i, s in enumerate(b.plan.segments)]
        b = dataclasses.replace(b, plan=dataclasses.replace(b.plan, segments=segments))
    rest = set(range(len(b.plan.segments))) - set(kept)
    seqs, targets, lengths = torch.arange(b.tree.num_sequences), b.seq_targets, b.seq_lengths
    reuse = {} if engine.reuse_forward_kv else None
    with torch.no_grad():
        lp_all, ent_all = engine._forward_all(b, entropy, rest, reuse)
    graphs = []
    for i in sorted(kept):
        lp, ent, _ = engine._call(b, i, [], capture=False, grad=True, entropy=entropy)
        lp_all[b.targets[i]] = lp.detach()
        if entropy:
            ent_all[b.targets[i]] = ent.detach()
        graphs.append((i, lp, ent))
    engine.stats.kept_graphs += len(graphs)
    loss, g_lp, g_ent = loss_gradients(b, lp_all, ent_all, loss_fn, separable, seqs, targets, lengths)
    while graphs:  # last first: each backward frees its graph before the next
        i, lp, ent = graphs.pop()
        torch.autograd.backward(*outputs_and_grads(b, i, lp, ent, g_lp, g_ent))
        del lp, ent
    engine._grad_pass(b, g_lp, g_ent, rest, reuse)
    return float(loss)
