"""Inputs of the engine tests: a hypothesis strategy for random forests (deep chains, wide
fans, 1-token nodes, duplicates, strict prefixes, sequences sharing nothing, single
sequences, 1-token sequences), forests of a fixed topology with random tokens, and a random,
non-linear loss (per-token weights + a GSPO-like exp(mean logprob) per sequence, optionally
entropy terms and a term coupling the sequences)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from helpers.models import VOCAB
from treerl import PrefixTree


@dataclass
class RandomLoss:
    """sum_i [ sum_t w_it lp_it + c_i exp(mean_t lp_it) (+ sum_t v_it H_it + d_i H_i.mean()^2) ]
    (+ a term coupling all sequences when ``coupled``: 0.1 logsumexp_i mean_t lp_it).

    Random but well conditioned: within a sequence all coefficients share one random sign
    and are bounded away from 0, so dL/dlp never nearly cancels. With ``one_sign`` every
    sequence has the same sign, so the contributions of sequences sharing a token (e.g.
    duplicates) do not cancel either: float32 tests need it, as cancelling sums turn float32
    rounding into large relative gradient errors.
    Accepts ``index=`` (separable calls with a subset of the sequences) and checks every
    tensor it gets has the right length and dtype, so a mis-ordered gather fails loudly.
    """

    weights: list[torch.Tensor]
    seq_coef: torch.Tensor
    ent_weights: list[torch.Tensor]
    ent_coef: torch.Tensor
    coupled: bool = False
    dtype: torch.dtype | None = None
    calls: list | None = None

    @staticmethod
    def make(seqs, gen: torch.Generator, *, coupled: bool = False, dtype=None, one_sign: bool = False) -> "RandomLoss":
        lengths = [len(s) - 1 for s in seqs]
        sign = torch.randint(0, 2, (1 if one_sign else len(seqs),), generator=gen).to(torch.float64) * 2 - 1
        sign = sign.expand(len(seqs))
        u = lambda lo, hi, *shape: lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
        return RandomLoss(
            weights=[sign[i] * u(0.5, 1.5, n) for i, n in enumerate(lengths)],
            seq_coef=sign * u(0.5, 3.0, len(seqs)),
            ent_weights=[sign[i] * u(0.5, 1.5, n) for i, n in enumerate(lengths)],
            ent_coef=sign * u(0.1, 1.0, len(seqs)),
            coupled=coupled,
            dtype=dtype,
            calls=[],
        )

    def __call__(self, lps, ents=None, *, index=None):
        idx = list(range(len(self.weights))) if index is None else index.tolist()
        self.calls.append(list(idx))
        assert len(lps) == len(idx), "loss_fn got a different number of sequences than index names"
        if self.coupled:
            assert index is None or len(idx) == len(self.weights)
        terms, means = [], []
        for k, (i, lp) in enumerate(zip(idx, lps)):
            assert lp.shape == self.weights[i].shape, f"sequence {i}: logprobs of shape {tuple(lp.shape)}"
            if self.dtype is not None:
                assert lp.dtype == self.dtype, lp.dtype
            mean = lp.sum() / max(len(lp), 1)
            t = (self.weights[i].to(lp.dtype) * lp).sum() + self.seq_coef[i].to(lp.dtype) * torch.exp(mean)
            if ents is not None:
                h = ents[k]
                assert h.shape == lp.shape
                t = t + (self.ent_weights[i].to(h.dtype) * h).sum()
                t = t + self.ent_coef[i].to(h.dtype) * (h.sum() / max(len(h), 1)) ** 2
            terms.append(t)
            if len(lp):
                means.append(mean)
        loss = torch.stack(terms).sum()
        if self.coupled and means:
            loss = loss + 0.1 * torch.logsumexp(torch.stack(means), 0)
        return loss


def rows_token_grad(term, seen: list | None = None):
    """``token_grad`` for :func:`treerl.engine.loss_head.token_loss_head` from ``term(lp, ent,
    rows) -> per-row terms`` (rows a slice), by autograd; appends each (start, stop) to ``seen``."""

    def token_grad(start, stop, lp, ent):
        if seen is not None:
            seen.append((start, stop))
        lp = lp.detach().requires_grad_()
        ent = ent.detach().requires_grad_() if ent is not None else None
        with torch.enable_grad():
            part = term(lp, ent, slice(start, stop)).sum()
            grads = torch.autograd.grad(part, [lp] + ([ent] if ent is not None else []))
        return part.detach(), grads[0], grads[1] if ent is not None else None

    return token_grad


class TokenwiseLoss:
    """sum_t [w_t lp_t + u_t exp(lp_t) (+ v_t H_t + s_t H_t^2)]: a sum of per-token terms,
    nonlinear in each token's values, offered as ``token_loss`` (the engine's fused head)
    and called as a separable loss. ``token_calls`` counts the fused head's calls; ``seen``
    holds the flat tokens of every evaluation (each must be seen once a step)."""

    def __init__(self, seqs, gen: torch.Generator, one_sign: bool = False):
        lengths = [len(s) - 1 for s in seqs]
        n = sum(lengths)
        sign = 1.0 if one_sign else torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
        u = lambda lo, hi: lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64)  # noqa: E731
        self.coef = [sign * u(0.5, 1.5), sign * u(0.5, 2.0), sign * u(0.5, 1.5), sign * u(0.1, 0.5)]
        self.offsets = [0] + torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()
        self.token_calls = 0
        self.seen: list[torch.Tensor] = []

    def token_loss(self, lp, ent, tokens):
        self.token_calls += 1
        return self._value(lp, ent, tokens)

    def _value(self, lp, ent, tokens):
        self.seen.append(tokens.cpu())
        w, u, v, s = (c.to(lp.device)[tokens].to(lp.dtype) for c in self.coef)
        loss = (w * lp + u * torch.exp(lp)).sum()
        if ent is not None:
            loss = loss + (v * ent + s * ent * ent).sum()
        return loss

    def __call__(self, lps, ents=None, *, index=None):
        idx = list(range(len(self.offsets) - 1)) if index is None else index.tolist()
        tokens = torch.cat([torch.arange(self.offsets[i], self.offsets[i + 1]) for i in idx])
        ent = torch.cat(list(ents)) if ents is not None else None
        return self._value(torch.cat(list(lps)), ent, tokens.to(lps[0].device))


@st.composite
def forests(draw, vocab: int = VOCAB, max_seqs: int = 8, max_len: int = 24, min_seqs: int = 1, alphabets=None):
    """A list of token-id lists with the shapes the tree must handle.

    Sequences are made one at a time: fresh (shares nothing, or little with a tiny
    alphabet), single-token, a branch off an existing one, an extension (deep chains),
    a fan of 1-token children at one point (wide fans, 1-token nodes), a duplicate, or a
    strict prefix.
    """
    alphabet = draw(st.sampled_from(alphabets or [2, 3, vocab]))
    tok = st.integers(0, alphabet - 1)
    n = draw(st.integers(min_seqs, max_seqs))
    seqs: list[list[int]] = []
    while len(seqs) < n:
        kinds = ["fresh", "single"] + (["branch", "extend", "fan", "duplicate", "prefix"] if seqs else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "fresh":
            new = [draw(st.lists(tok, min_size=1, max_size=max_len))]
        elif kind == "single":
            new = [[draw(tok)]]
        else:
            base = seqs[draw(st.integers(0, len(seqs) - 1))]
            if kind == "branch":
                cut = draw(st.integers(0, len(base)))
                new = [base[:cut] + draw(st.lists(tok, min_size=1, max_size=max_len))]
            elif kind == "extend":
                new = [base + draw(st.lists(tok, min_size=1, max_size=max_len))]
            elif kind == "fan":
                cut = draw(st.integers(0, len(base)))
                width = draw(st.integers(2, 5))
                new = [base[:cut] + [draw(tok)] for _ in range(width)]
            elif kind == "duplicate":
                new = [list(base)]
            else:  # strict prefix (or the whole sequence when it has one token)
                new = [base[: draw(st.integers(1, max(1, len(base) - 1)))]]
        for s in new:
            if len(seqs) < n:
                seqs.append(s[:max_len])
    order = draw(st.permutations(range(len(seqs))))
    return [seqs[i] for i in order]


def tree_sizes(tree: PrefixTree) -> list[int]:
    """Tokens of each tree of the forest (layout order)."""
    roots = tree.node_start[tree.node_parent < 0]
    return (tree.subtree_end[roots] - roots).tolist()


def longest_node(tree: PrefixTree) -> int:
    return int((tree.node_end - tree.node_start).max())


def random_seq(gen: torch.Generator, length: int, vocab: int = VOCAB, exclude=()) -> list[int]:
    """Random ids; the first token avoids ``exclude`` (to force a branch point)."""
    out = torch.randint(0, vocab, (length,), generator=gen).tolist()
    while out and out[0] in exclude:
        out[0] = int(torch.randint(0, vocab, (1,), generator=gen))
    return out


def shaped_forest(gen: torch.Generator, spec, vocab: int = VOCAB) -> list[list[int]]:
    """Sequences of a forest with a fixed topology and random tokens.

    ``spec`` is a list of root nodes; a node is ``(length, [children])`` or
    ``(length, [children], True)`` when a sequence also ends at the node. Every leaf is
    the end of a sequence. Siblings start with distinct tokens, so the topology is exact.
    """
    seqs: list[list[int]] = []

    def visit(nodes, prefix):
        used: set[int] = set()
        for node in nodes:
            length, kids = node[0], node[1]
            toks = random_seq(gen, length, vocab, exclude=used)
            used.add(toks[0])
            path = prefix + toks
            if not kids or (len(node) > 2 and node[2]):
                seqs.append(path)
            visit(kids, path)

    visit(spec, [])
    perm = torch.randperm(len(seqs), generator=gen).tolist()
    return [seqs[i] for i in perm]


# A small forest (every engine mode exercised: chains, fans, 1-token nodes) and per-mode settings
# that split it into several calls: the exactness tests of model variants (LoRA, MoE) share them.
SMALL_SPEC = [(6, [(3, [(4, []), (2, [(3, []), (3, [])])]), (5, []), (1, [(1, []), (1, [])])]), (4, []),
              (9, [(2, []), (3, [])])]
SMALL_MODE_KW = {"flat": dict(max_tokens=20), "packed": dict(max_tokens=48), "dfs": dict(chunk_tokens=4),
                 "auto": dict(max_tokens=11, chunk_tokens=4)}
