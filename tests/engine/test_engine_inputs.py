"""Bad input through TreeEngine: every error names the sequence (or tree) and the problem,
and nothing is accumulated into .grad when a step is refused."""

from __future__ import annotations

import re

import pytest
import torch

from helpers.forests import RandomLoss, random_seq, tree_sizes
from helpers.models import VOCAB, get_model
from helpers.reference import reference_logprobs, zero_grads
from treerl import PrefixTree, TreeEngine, TreeTooLargeError
from treerl.models import build_model

MODES = ("flat", "packed", "dfs", "auto")


def _sum_loss(lps, ents=None, index=None):
    return sum((lp * (k + 1)).sum() for k, lp in enumerate(lps))


def _entry_points(engine, seqs):
    """Every public call that takes sequences."""
    return {
        "logprobs": lambda: engine.logprobs(seqs),
        "logprobs_entropy": lambda: engine.logprobs(seqs, entropy=True),
        "forward": lambda: engine.forward(seqs),
        "forward_backward": lambda: engine.forward_backward(seqs, _sum_loss),
        "forward_backward_separable": lambda: engine.forward_backward(seqs, _sum_loss, separable=True),
    }


def assert_refused(model, mode, seqs, exc, parts, **kw):
    engine = TreeEngine(model, mode, **kw)
    for name, call in _entry_points(engine, seqs).items():
        zero_grads(model)
        with pytest.raises(exc) as info:
            call()
        msg = str(info.value)
        for part in parts:
            assert re.search(part, msg), f"{name}: {part!r} not in {msg!r}"
        assert all(p.grad is None for p in model.parameters()), f"{name}: gradients were touched"


# ------------------------------------------------------------------- token ids
@pytest.mark.parametrize("mode", MODES)
def test_token_id_outside_vocabulary(mode, gen):
    model = get_model("qwen3")
    seqs = [random_seq(gen, 5), random_seq(gen, 4), random_seq(gen, 6), random_seq(gen, 3)]
    seqs[2][3] = VOCAB  # first id past the vocabulary
    assert_refused(model, mode, seqs, ValueError, ["sequence 2", f"token id {VOCAB}", "position 3", "vocabulary", str(VOCAB)])
    # in a shared prefix the first sequence (input order) holding it is named
    seqs = [random_seq(gen, 4), [5, 6, VOCAB + 7, 1], [5, 6, VOCAB + 7, 2], [3]]
    assert_refused(model, mode, seqs, ValueError, ["sequence 1", f"token id {VOCAB + 7}", "position 2"])
    # the largest id that is in the vocabulary is fine
    seqs = [random_seq(gen, 4), [VOCAB - 1, 0, VOCAB - 1]]
    lps = TreeEngine(model, mode).logprobs(seqs)
    assert [len(x) for x in lps] == [3, 2]


@pytest.mark.parametrize("mode", MODES)
def test_sequence_longer_than_the_context(mode, gen):
    model = get_model("qwen3", max_position_embeddings=16)
    seqs = [random_seq(gen, 16), random_seq(gen, 17), random_seq(gen, 3)]
    assert_refused(model, mode, seqs, ValueError, ["sequence 1", "17 tokens", "16", "max_position_embeddings"])
    # exactly the context length is fine, and exact
    ok = [seqs[0], seqs[0][:9] + random_seq(gen, 7, exclude=(seqs[0][9],))]
    lps = TreeEngine(model, mode).logprobs(ok)
    ref, _ = reference_logprobs(model, ok)
    for a, b in zip(lps, ref):
        assert (a - b).abs().max() < 1e-12


# ----------------------------------------------------------- malformed sequences
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "seqs,exc,parts",
    [
        ([], ValueError, ["no sequences"]),
        ([[1, 2], [], [3]], ValueError, ["sequence 1", "empty"]),
        ([[1, 2], [3], torch.tensor([], dtype=torch.long)], ValueError, ["sequence 2", "empty"]),
        ([[1, 2], torch.tensor([1.0, 2.0])], TypeError, ["sequence 1", "integers", "float"]),
        ([[1, 2], [3], [4, 5.5]], TypeError, ["sequence 2", "integers"]),
        ([[1, 2], ["a", "b"]], TypeError, ["sequence 1", "integers"]),
        ([[1, 2], [True, False]], TypeError, ["sequence 1", "integers"]),
        ([[1, 2], torch.ones(2, 2, dtype=torch.long)], ValueError, ["sequence 1", "1-D"]),
        ([[1, 2], [3, -4]], ValueError, ["sequence 1", "-4", "negative"]),
        ("1 2 3", TypeError, ["list of token sequences"]),
    ],
    ids=["no-seqs", "empty", "empty-tensor", "float-tensor", "float", "str", "bool", "2d", "negative", "string"],
)
def test_malformed_sequences(mode, seqs, exc, parts):
    assert_refused(get_model("llama"), mode, seqs, exc, parts)


# --------------------------------------------------------------- tree too large
def test_tree_larger_than_max_tokens_packed(gen):
    model = get_model("qwen2")
    big_prompt = random_seq(gen, 6, exclude=(0, 1, 2))
    seqs = [
        big_prompt + random_seq(gen, 4),  # 10
        [0] + random_seq(gen, 2),  # its own tree of 3 tokens
        big_prompt + random_seq(gen, 3),  # shares 6 -> the big tree has 13 tokens
    ]
    seqs[2][6] = (seqs[0][6] + 1) % VOCAB  # branch right after the prompt
    tree = PrefixTree.from_sequences(seqs)
    assert tree_sizes(tree) == [3, 13]
    for max_tokens in (1, 12):
        engine = TreeEngine(model, "packed", max_tokens=max_tokens)
        parts = ["sequences 0, 2", "13 tokens", f"max_tokens={max_tokens}", "auto", "dfs"] if max_tokens == 12 else ["max_tokens=1"]
        with pytest.raises(TreeTooLargeError) as info:
            engine.plan(seqs)
        for p in parts:
            assert p in str(info.value), str(info.value)
        if max_tokens == 12:  # the input sequences of the big tree, not its layout position
            assert "the tree of sequences 0, 2 has 13 tokens" in str(info.value)
        assert_refused(model, "packed", seqs, TreeTooLargeError, parts, max_tokens=max_tokens)
    assert issubclass(TreeTooLargeError, ValueError)
    # exactly the tree's size fits; auto and dfs split whatever does not
    TreeEngine(model, "packed", max_tokens=13).logprobs(seqs)
    for mode in ("auto", "dfs"):
        TreeEngine(model, mode, max_tokens=2, chunk_tokens=2).logprobs(seqs)


def test_tree_too_large_names_an_input_sequence():
    model = get_model("qwen2")
    seqs = [[50, 1, 2, 3, 4, 5, 6], [1, 2], [50, 1, 9]]  # the big tree holds sequences 0 and 2
    with pytest.raises(TreeTooLargeError, match=r"sequences? 0\b"):
        TreeEngine(model, "packed", max_tokens=5).logprobs(seqs)


def test_sequence_larger_than_max_tokens_flat_runs_chained(gen):
    """flat accepts any length: a sequence over max_tokens runs as a chain of pieces
    (exactness of such plans: test_engine_exact.py); packed still refuses the tree."""
    model = get_model("qwen2")
    shared = random_seq(gen, 6)
    seqs = [shared, shared + random_seq(gen, 3), random_seq(gen, 2, exclude=(shared[0],))]  # flat: 9 tokens
    ref, _ = reference_logprobs(model, seqs)
    for max_tokens in (1, 4, 8, 9):
        engine = TreeEngine(model, "flat", max_tokens=max_tokens)
        plan = engine.plan(seqs)
        assert max(s.size for s in plan.segments) <= max_tokens
        assert plan.single_level == (max_tokens >= 9)
        for got, want in zip(engine.logprobs(seqs), ref):
            torch.testing.assert_close(got, want.detach(), rtol=1e-9, atol=1e-9)
    assert_refused(model, "packed", seqs, TreeTooLargeError, ["sequences 0, 1", "9 tokens", "max_tokens=8", "whole"],
                   max_tokens=8)
    TreeEngine(model, "packed", max_tokens=9).logprobs(seqs)  # shared: the tree has 9 tokens too


# --------------------------------------------------------------- engine options
@pytest.mark.parametrize(
    "kwargs,parts",
    [
        (dict(mode="fast"), ["unknown mode 'fast'", "flat", "packed", "dfs", "auto"]),
        (dict(mode="DFS"), ["unknown mode"]),
        (dict(max_tokens=0), ["max_tokens", "at least 1"]),
        (dict(max_tokens=-5), ["max_tokens", "-5"]),
        (dict(max_tokens=2.5), ["max_tokens", "2.5"]),
        (dict(chunk_tokens=0), ["chunk_tokens", "at least 1"]),
        (dict(chunk_tokens=-1), ["chunk_tokens", "-1"]),
        (dict(chunk_tokens=1.5), ["chunk_tokens", "1.5"]),
        (dict(attention="xformers"), ["unknown attention backend 'xformers'", "sdpa", "flex"]),
        (dict(attention="flex"), ["flex", "CUDA"]),
        (dict(temperature=0.0), ["temperature", "positive"]),
        (dict(temperature=-1.0), ["temperature", "positive"]),
        (dict(temperature=float("nan")), ["temperature", "positive"]),
    ],
)
def test_bad_engine_options(kwargs, parts):
    model = get_model("qwen3")
    kwargs = {"mode": "auto", **kwargs}
    with pytest.raises(ValueError) as info:
        TreeEngine(model, kwargs.pop("mode"), **kwargs)
    for part in parts:
        assert part in str(info.value), str(info.value)


def test_max_and_chunk_tokens_of_one_are_valid(gen):
    model = get_model("qwen3")
    seqs = [random_seq(gen, 4), random_seq(gen, 3)]
    ref, _ = reference_logprobs(model, seqs)
    for mode in ("dfs", "auto"):
        lps = TreeEngine(model, mode, max_tokens=1, chunk_tokens=1).logprobs(seqs)
        assert all((a - b).abs().max() < 1e-12 for a, b in zip(lps, ref))


def test_unsupported_models():
    base = get_model("qwen3").model  # no LM head
    with pytest.raises(TypeError, match="no output embedding"):
        TreeEngine(base)
    model = build_model("qwen3", "tiny", vocab_size=VOCAB)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        TreeEngine(model)
    model = build_model("llama", "tiny", vocab_size=VOCAB)
    model.lm_head = torch.nn.Linear(64, VOCAB, bias=True)
    with pytest.raises(NotImplementedError, match="bias"):
        TreeEngine(model)


# ---------------------------------------------------------------------- loss_fn
BAD_LOSSES = {
    "vector": (lambda lps, index=None: torch.stack([lp.sum() for lp in lps] * 2), TypeError, "scalar"),
    "python float": (lambda lps, index=None: 1.0, TypeError, "scalar"),
    "None": (lambda lps, index=None: None, TypeError, "scalar"),
    "constant tensor": (lambda lps, index=None: torch.tensor(2.0, dtype=torch.float64), ValueError, "does not depend"),
    "detached": (lambda lps, index=None: sum(lp.sum() for lp in lps).detach(), ValueError, "does not depend"),
}


# (mode, separable, max_tokens, the path forward_backward takes)
LOSS_PATHS = [
    ("packed", True, 8, "segments"),  # several micro-batches, one loss call each
    ("flat", True, 8, "segments"),
    ("packed", False, 64, "segments"),  # one micro-batch
    ("packed", False, 8, "two-phase"),  # several micro-batches, non-separable
    ("dfs", False, 8, "two-phase"),
    ("auto", True, 4, "chained"),  # chains, separable: the one pass over segments (loss per segment of sequence ends)
]


def three_trees(gen):
    """Three sequences sharing nothing (distinct first tokens): 6, 6 and 4 tokens."""
    first = random_seq(gen, 6, exclude=(0,))
    return [first, [0] + random_seq(gen, 5), random_seq(gen, 4, exclude=(0, first[0]))]


@pytest.mark.parametrize("mode,separable,max_tokens,path", LOSS_PATHS)
@pytest.mark.parametrize("name", list(BAD_LOSSES))
def test_bad_loss_fn(name, mode, separable, max_tokens, path, gen):
    fn, exc, part = BAD_LOSSES[name]
    model = get_model("qwen3")
    seqs = three_trees(gen)
    engine = TreeEngine(model, mode, max_tokens=max_tokens, chunk_tokens=3)
    plan = engine.plan(seqs)
    one_pass = plan.single_level and (separable or len(plan.segments) == 1)
    assert one_pass == (path == "segments"), plan.describe()
    zero_grads(model)
    with pytest.raises(exc, match=part):
        engine.forward_backward(seqs, fn, separable=separable)
    assert all(p.grad is None for p in model.parameters()), "a refused loss changed .grad"


BAD_TOKEN_LOSSES = {
    "vector": (lambda lp, ent, tokens: lp * 2, TypeError, "token_loss must return a scalar"),
    "python float": (lambda lp, ent, tokens: 1.0, TypeError, "token_loss must return a scalar"),
    "constant tensor": (lambda lp, ent, tokens: torch.tensor(2.0, dtype=torch.float64), ValueError, "does not depend"),
    "detached": (lambda lp, ent, tokens: lp.sum().detach(), ValueError, "does not depend"),
}


@pytest.mark.parametrize("mode,max_tokens", [("packed", 8), ("flat", 8), ("packed", 64)])
@pytest.mark.parametrize("name", list(BAD_TOKEN_LOSSES))
def test_bad_token_loss(name, mode, max_tokens, gen):
    """A loss whose ``token_loss`` (the fused head's per-token form) is malformed: refused with
    what is wrong, in the head's first chunk, before any gradient is written."""
    fn, exc, part = BAD_TOKEN_LOSSES[name]

    def loss_fn(lps, index=None):
        return sum(lp.sum() for lp in lps)

    loss_fn.token_loss = fn
    model = get_model("qwen3")
    engine = TreeEngine(model, mode, max_tokens=max_tokens)
    zero_grads(model)
    with pytest.raises(exc, match=part):
        engine.forward_backward(three_trees(gen), loss_fn, separable=True)
    assert all(p.grad is None for p in model.parameters()), "a refused loss changed .grad"


def test_good_loss_after_refused_loss_is_exact(gen):
    """A refused step leaves no state behind: the next step is exact."""
    model = get_model("llama")
    seqs = [random_seq(gen, 6), random_seq(gen, 5)]
    engine = TreeEngine(model, "auto", max_tokens=4, chunk_tokens=2)
    with pytest.raises(TypeError):
        engine.forward_backward(seqs, BAD_LOSSES["python float"][0])
    assert model.config._attn_implementation == "sdpa"
    loss = RandomLoss.make(seqs, gen)
    zero_grads(model)
    engine.forward_backward(seqs, loss)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    zero_grads(model)
    lps, _ = reference_logprobs(model, seqs)
    loss(lps).backward()
    for n, p in model.named_parameters():
        assert (got[n] - p.grad).norm() <= 1e-9 * max(p.grad.norm(), 1e-300) + 1e-14, n
    zero_grads(model)


@pytest.mark.parametrize("mode,separable,max_tokens,path", LOSS_PATHS[:3])
def test_loss_of_shape_one_is_a_scalar_or_refused_cleanly(mode, separable, max_tokens, path, gen):
    """The two-phase path accepts a loss of shape [1]; the one-pass path must agree (or
    refuse it with the scalar TypeError before touching .grad)."""
    model = get_model("qwen3")
    seqs = three_trees(gen)
    fn = lambda lps, index=None: sum(lp.sum() for lp in lps).reshape(1)  # noqa: E731
    zero_grads(model)
    two_phase = TreeEngine(model, "dfs", chunk_tokens=3).forward_backward(seqs, fn)
    zero_grads(model)
    try:
        value = TreeEngine(model, mode, max_tokens=max_tokens, chunk_tokens=3).forward_backward(seqs, fn, separable=separable)
    except TypeError as e:
        assert "scalar" in str(e) and all(p.grad is None for p in model.parameters())
    else:
        assert value == pytest.approx(two_phase, rel=1e-12)
    zero_grads(model)
