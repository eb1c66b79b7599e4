"""The router's load-balancing loss (Switch Transformer; Hugging Face's
``load_balancing_loss_func``) for tree training, exact: ``algorithm.router_aux_coef``.

Over a batch of sequences, with every sparse layer's router pooled (as HF does):

    aux = E * sum_e f_e * P_e,
    f_e = share of (token, layer) pairs routing to expert e (top-k; no gradient),
    P_e = mean router probability of expert e over the (token, layer) pairs,

where the tokens are each sequence's positions ``0 .. L-2`` (those whose next-token logits
the loss reads; a sequence's last token predicts nothing). A prefix shared by several
sequences is one tree token but counts once per sequence through it, so ``aux`` equals the
loss of the flat batch. Its gradient is ``coef * E * f_e / (layers x tokens)`` on each
token's router probability of expert ``e``, times the token's multiplicity: linear in the
probabilities once ``f`` is known. So :func:`forward_backward_with_router_aux` runs

1. a no-grad tree forward that counts the routing (``f``, and ``P`` for the value), then
2. the engine's ``forward_backward``, during which every router's probabilities pass through
   an identity whose backward adds that gradient (each (token, layer) exactly once: every
   call's router runs once with grad; a recomputed block's second run is not in the graph).

Cost: one more no-grad forward per update. The tokens of an engine call are read from its
tree attention (``active_tree_attention().q_index``; padding rows of a call count nothing).
"""

from __future__ import annotations

import torch

from .engine.attention import active_tree_attention
from .engine.kernel_plans import engine_call
from .engine.memory import sparse_layers
from .moe import router_hook


class _AddGrad(torch.autograd.Function):
    """Identity whose backward adds a fixed gradient."""

    @staticmethod
    def forward(ctx, x, extra):
        ctx.save_for_backward(extra)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (extra,) = ctx.saved_tensors
        return grad + extra, None


class RouterAux:
    """The load-balancing loss of one batch (``tree``) through ``engine`` (see the module
    docstring): :meth:`count` during a no-grad forward, then :meth:`inject` during the
    engine's ``forward_backward``."""

    def __init__(self, engine, tree, coef: float):
        config = engine.model.config
        self.experts, self.layers, self.coef = config.num_experts, sparse_layers(config), float(coef)
        if not self.layers:
            raise ValueError("the router's load-balancing loss needs a mixture-of-experts model")
        layout = engine._layout(tree)  # the engine's token layout (flat: every sequence its own)
        keep = torch.ones(layout.num_flat_tokens, dtype=torch.bool)
        keep[layout.seq_offsets[1:] - 1] = False  # each sequence's last token
        weight = torch.bincount(layout.seq_index[keep], minlength=layout.num_tree_tokens)
        self.pairs = float(weight.sum()) * self.layers  # (token, layer) pairs of the flat batch
        self.weight = weight.to(engine.device)
        self.routed = torch.zeros(self.experts, dtype=torch.float64, device=engine.device)
        self.prob = torch.zeros(self.experts, dtype=torch.float64, device=engine.device)
        self.calls = 0

    def _rows(self, n_rows: int) -> torch.Tensor:
        """Multiplicity of each row of the current call ``[n_rows]`` (0 for padding rows)."""
        ctx = active_tree_attention()
        if ctx is None:
            raise RuntimeError("the router's load-balancing loss needs the engine's tree attention context")
        w = torch.zeros(n_rows, dtype=torch.float64, device=self.weight.device)
        n = len(ctx.q_index)
        w[:n] = self.weight[ctx.q_index].to(torch.float64)
        return w

    def count(self, probs: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """Router hook of the no-grad forward: accumulate the routing and the probabilities."""
        w = self._rows(probs.shape[0])
        self.routed.index_add_(0, top_i.reshape(-1), w.repeat_interleave(top_i.shape[1]))
        self.prob += (w[:, None] * probs.to(torch.float64)).sum(0)
        self.calls += 1
        return probs

    def inject(self, probs: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """Router hook of the forward with grad: the probabilities, with the loss's gradient added in the backward."""
        if not probs.requires_grad:
            return probs
        f = self.routed / self.pairs
        extra = (self.coef * self.experts / self.pairs) * self._rows(probs.shape[0])[:, None] * f[None, :]
        return _AddGrad.apply(probs, extra.to(probs.dtype))

    @property
    def value(self) -> float:
        """``aux`` of the batch (not multiplied by the coefficient)."""
        return float(self.experts * (self.routed / self.pairs * self.prob / self.pairs).sum())


def forward_backward_with_router_aux(engine, tree, loss_fn, coef: float, **kwargs) -> tuple[float, float]:
    """``engine.forward_backward(tree, loss_fn, **kwargs)`` with ``coef x aux`` added to the
    loss (its gradient accumulated too). Returns (loss + coef x aux, aux)."""
    from .engine.tree import PrefixTree

    if not isinstance(tree, PrefixTree):
        tree = PrefixTree.from_sequences(tree)
    engine.memory.max_tokens  # noqa: B018 - the memory model's probe forwards (CUDA) run before any router is recorded
    aux = RouterAux(engine, tree, coef)
    with engine_call():  # both passes one allowance of new cuDNN shapes: the same attention kernels, the same routes
        with router_hook(aux.count):
            engine.forward(tree)
        with router_hook(aux.inject):
            loss = engine.forward_backward(tree, loss_fn, **kwargs)
    return loss + coef * aux.value, aux.value
