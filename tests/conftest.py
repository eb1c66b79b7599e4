"""Shared helpers for the treerl CPU test suite.

- tiny models of every supported family, with random weights large enough that attention
  is sharp and logits are far from uniform (so a wrong mask or position shows up clearly);
- an *independent* per-sequence reference: the Hugging Face model itself, one sequence per
  call, with its own attention implementation; log-softmax in float64;
- a hypothesis strategy for random forests (deep chains, wide fans, 1-token nodes,
  duplicates, strict prefixes, sequences sharing nothing, single sequences, 1-token
  sequences);
- a random, non-linear loss (per-token weights + a GSPO-like exp(mean logprob) per
  sequence, optionally entropy terms and a term coupling the sequences).

The session seed is random (fresh inputs every run) and printed in the report header; set
``TREERL_TEST_SEED`` to reproduce a run. Hypothesis prints its own reproduction blob.
"""

from __future__ import annotations

import functools
import os
import random
import zlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st

from treerl import PrefixTree
from treerl.models import build_model, rmsnorm_in_input_precision

# Tiny models do not gain from intra-op threads, and with a busy 2-core machine the
# OpenMP threads of 2 torch threads spin against each other (16 ms per small matmul).
torch.set_num_threads(1)

VOCAB = 64
SESSION_SEED = int(os.environ.get("TREERL_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"treerl test seed: TREERL_TEST_SEED={SESSION_SEED}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Every failure report says how to rebuild the same model weights and inputs."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("treerl seed", f"reproduce with TREERL_TEST_SEED={SESSION_SEED}"))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A torch generator with a fresh seed per test (derived from the session seed)."""
    seed = (SESSION_SEED * 1_000_003 + zlib.crc32(request.node.nodeid.encode())) % (2**63)
    print(f"generator seed for {request.node.nodeid}: {seed} (session {SESSION_SEED})")
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- models
# name -> (family, config overrides). The `tiny` shape: hidden 64, 2 layers, 4 query heads,
# 2 KV heads (grouped-query attention), head_dim 16.
VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", dict(tie_word_embeddings=False)),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),  # q/k/v biases
    "qwen2-tied-mqa": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied-mha": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
}


@torch.no_grad()
def _randomise(model: torch.nn.Module, seed: int, soft: bool = False) -> None:
    """Weights of O(1) effect: sharp attention, logits spread over several nats.

    float64 models are sharp: tied variants predict some tokens with p > 0.999 and some
    attention rows are nearly one-hot. In float32 such spots carry relative rounding errors
    ~1e-5..1e-3 in *any* float32 pipeline (1 - p of a near-certain token; the softmax
    backward of a sharp row), and the reference reduces its logits in float64, so float32
    models are ``soft``: smaller projections and norm weights (max p ~0.1 untied, ~0.8 tied)."""
    g = torch.Generator().manual_seed(seed)
    gain, norm_lo, norm_span = (1.0, 0.5, 0.5) if soft else (1.5, 0.5, 1.0)
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            new = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5
        elif name.endswith("bias"):
            new = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2
        elif p.dim() == 1:  # norm weights
            new = norm_lo + norm_span * torch.rand(p.shape, generator=g, dtype=torch.float64)
        else:
            new = torch.randn(p.shape, generator=g, dtype=torch.float64) * (gain / p.shape[1] ** 0.5)
        p.copy_(new.to(p.dtype))
    if soft and model.config.tie_word_embeddings:
        # the residual stream carries the input embedding, so a tied head predicts the
        # input token again with p ~ 0.99: soften the logits
        model.model.norm.weight.mul_(0.25)


@functools.lru_cache(maxsize=None)
def get_model(variant: str = "qwen3", dtype: torch.dtype = torch.float64, vocab_size: int = VOCAB, **extra):
    """A cached tiny model (float64: sharp; other dtypes: soft, see _randomise). Tests
    only touch .grad."""
    family, overrides = VARIANTS[variant]
    model = build_model(family, "tiny", dtype=torch.float64, vocab_size=vocab_size, **{**overrides, **extra})
    _randomise(model, SESSION_SEED + sum(map(ord, variant)), soft=dtype != torch.float64)
    model = rmsnorm_in_input_precision(model.to(dtype))
    model.train(False)  # no dropout anywhere
    assert model.config._attn_implementation == "sdpa"
    return model


def zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where autograd left None)."""
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


# ----------------------------------------------------------------- the reference
def reference_logprobs(model, seqs, *, temperature: float = 1.0):
    """Per sequence: log p(t_j | t_<j) for j = 1..L-1 and the entropies of those
    distributions, from one plain HF forward per sequence (float64 log-softmax)."""
    assert model.config._attn_implementation == "sdpa", "the model was left switched to another attention"
    lps, ents = [], []
    for s in seqs:
        ids = torch.as_tensor(s, dtype=torch.long)
        logits = model(input_ids=ids[None]).logits[0].to(torch.float64) / temperature
        logp = torch.log_softmax(logits[:-1], dim=-1)
        lps.append(logp.gather(1, ids[1:, None])[:, 0])
        ents.append(-(logp.exp() * logp).sum(-1))
    return lps, ents


def completion_logprobs(model, prompt, completion, temperature: float = 1.0) -> torch.Tensor:
    """log p of each completion token given all before it: one plain forward of prompt +
    completion (:func:`reference_logprobs`), float64."""
    with torch.no_grad():
        lps, _ = reference_logprobs(model, [list(prompt) + list(completion)], temperature=temperature)
    return lps[0][len(prompt) - 1:]


def reference_step(model, seqs, loss_fn, *, entropy: bool = False, temperature: float = 1.0):
    """(loss, grads, logprobs, entropies) of training on every sequence independently."""
    zero_grads(model)
    lps, ents = reference_logprobs(model, seqs, temperature=temperature)
    loss = loss_fn(lps, ents) if entropy else loss_fn(lps)
    loss.backward()
    grads = grads_of(model)
    zero_grads(model)
    return float(loss.detach()), grads, [x.detach() for x in lps], [x.detach() for x in ents]


# ------------------------------------------------------------------ comparisons
def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max(max |e|, 1) over the whole tensor (0 when both are empty).

    The floor of 1 (nats) matters for float32: a logprob near 0 or a small entropy comes
    out of a float32 softmax over logits of size ~10 with an absolute error ~1e-6."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.numel() == 0:
        return 0.0
    scale = max(expected.abs().max().item(), 1.0)
    err = (actual.to(torch.float64) - expected.to(torch.float64)).abs().max().item()
    return err / scale


def assert_seq_close(actual: list[torch.Tensor], expected: list[torch.Tensor], tol: float, what: str = "logprobs"):
    assert len(actual) == len(expected), f"{what}: {len(actual)} sequences, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape, f"{what} of sequence {i}: shape {tuple(a.shape)}, expected {tuple(e.shape)}"
        assert torch.isfinite(a).all(), f"{what} of sequence {i} not finite"
    a, e = torch.cat([x.to(torch.float64) for x in actual]), torch.cat(expected)
    if e.numel():
        err = rel_err(a, e)
        assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


# Per-parameter comparison floors, as a fraction of the whole reference gradient's norm.
# Some gradients are mathematically zero or nearly so (a query that sees one key, or keys
# whose values are all equal, gives q/k projections no gradient; k-bias gradients are sums
# that nearly cancel). There the reference is exactly 0 or rounding noise, and the engine's
# masked attention leaves its own noise (float64: up to ~5e-14, float32: up to ~4e-7 of
# the whole gradient), so such parameters are compared against floor * ||whole gradient||
# instead of their own norm: float64 1e-9 * 1e-3 = 1e-12, float32 1e-5 * 0.1 = 1e-6 of
# the whole gradient, both far below what any real defect does.
FLOOR = {torch.float64: 1e-3, torch.float32: 1e-1}
TOL = {torch.float64: 1e-9, torch.float32: 1e-5}


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float, floor: float):
    """Per parameter: ||g - g_ref|| <= tol * max(||g_ref||, floor * ||whole g_ref||)."""
    assert actual.keys() == expected.keys()
    total = torch.cat([g.to(torch.float64).flatten() for g in expected.values()]).norm().item()
    assert total > 0, "reference gradient is all zeros: the comparison would prove nothing"
    bad = []
    for name, ref in expected.items():
        got = actual[name]
        assert got.shape == ref.shape
        assert torch.isfinite(got).all(), f"{name}: gradient not finite"
        ref_norm = ref.to(torch.float64).norm().item()
        err = (got.to(torch.float64) - ref.to(torch.float64)).norm().item()
        if err > tol * max(ref_norm, floor * total):
            bad.append(f"{name}: error {err:.3e}, relative {err / max(ref_norm, 1e-300):.3e} (norm {ref_norm:.3e} of {total:.3e})")
    assert not bad, f"gradients differ (tol {tol:.0e}):\n" + "\n".join(bad)


# ------------------------------------------------------------------- random loss
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


# ------------------------------------------------------------------- random forests
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


class _Handles:
    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def after_each_forward(model: torch.nn.Module, fn) -> _Handles:
    """Call ``fn(query_length)`` at the end of every forward of ``model`` (after its LM head),
    whichever path ran it: the HF forward (prefill, decode of other families) or treerl's own
    decode blocks, which call the modules but not ``model.forward``. ``query_length`` is the
    length of the forward's input ids (1: a decode step). Returns a handle with ``remove()``."""
    seen = []
    pre = model.get_input_embeddings().register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    post = model.get_output_embeddings().register_forward_hook(lambda module, args, output: fn(seen.pop()))
    return _Handles(pre, post)


# A small forest (every engine mode exercised: chains, fans, 1-token nodes) and per-mode settings
# that split it into several calls: the exactness tests of model variants (LoRA, MoE) share them.
SMALL_SPEC = [(6, [(3, [(4, []), (2, [(3, []), (3, [])])]), (5, []), (1, [(1, []), (1, [])])]), (4, []),
              (9, [(2, []), (3, [])])]
SMALL_MODE_KW = {"flat": dict(max_tokens=20), "packed": dict(max_tokens=48), "dfs": dict(chunk_tokens=4),
                 "auto": dict(max_tokens=11, chunk_tokens=4)}
