"""Chain attention after a prefix (treerl.engine.chain_attention): the log-sum-exp merge of a
full and a causal part, and its backward from the merged output and log-sum-exp.

float64 on the CPU against autograd through a dense masked softmax over the concatenated keys
(1e-9 relative), also with the kernel calls' lengths on a grid (padded, as cuDNN's run); the
kernel probe's choices and refusals, the head limits of the fused kernels and the bound on
cuDNN's shapes; the engine end to end against the per-sequence reference on chains after
prefixes, with the path on (counted, by the engine's attention routes too) and off.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import treerl
import treerl.engine.attention as attention
import treerl.engine.chain_attention as chain
import treerl.engine.kernel_plans as plans
from helpers.attention import assert_rel, recording
from helpers.attention import dense_reference as dense_masked, inputs as random_inputs
from helpers.engine import check_engine
from helpers.forests import RandomLoss, random_seq
from helpers.models import get_model
from treerl.engine.memory import MemoryModel, MemoryPolicy


def dense_reference(q, k, v, prefix, scale):
    """Softmax attention over all keys: the prefix's seen by every query, its own causally."""
    n = q.shape[2]
    return dense_masked(q, k, v, torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix), scale)


def inputs(gen, heads, kv_heads, n, prefix, dim, dtype=torch.float64):
    """Random q [1, heads, n, dim], k/v [1, kv_heads, prefix + n, dim]."""
    return random_inputs(gen, heads, kv_heads, n, prefix + n, dim, dtype)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("prefix", [0, 1, 2, 45])
@pytest.mark.parametrize("n", [1, 3, 17])
def test_merge_and_backward_match_dense_attention(heads, kv_heads, prefix, n, gen):
    dim = int(torch.randint(2, 9, (1,), generator=gen)) * 4
    scale = float(torch.rand((), generator=gen, dtype=torch.float64)) + 0.2
    q, k, v = inputs(gen, heads, kv_heads, n, prefix, dim)
    q_big = (3 * q).detach().requires_grad_()  # sharper softmax: parts of very different weight
    for q in (q, q_big):
        grad = torch.randn(1, heads, n, dim, generator=gen, dtype=torch.float64)
        out = chain.chain_attention(q, k, v, scale)
        ref = dense_reference(q, k, v, prefix, scale)
        assert out.shape == ref.shape
        assert_rel(out, ref)
        for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
            assert_rel(got, want)


def _lse_as(layout):
    """MATH with its log-sum-exp in another kernel's format (cuDNN's [B, H, N, 1], the
    memory-efficient kernel's [B, H, N rounded up to 32] with junk in the padding)."""

    def forward(q, k, v, causal, scale):
        out, lse, extra = chain._math_forward(q, k, v, causal, scale)
        if layout == "column":
            return out, lse[..., None], extra
        padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), float("nan"), dtype=lse.dtype)
        padded[..., :lse.shape[2]] = lse
        return out, padded, extra

    return chain.Kernel(f"math-{layout}", forward, chain._math_backward)


@pytest.mark.parametrize("layout", ["column", "padded"])
@pytest.mark.parametrize("expand_kv", [False, True])
def test_kernel_formats_and_expanded_heads(layout, expand_kv, gen):
    kernel = _lse_as(layout)
    kernel = chain.Kernel(kernel.name, kernel.forward, kernel.backward, expand_kv=expand_kv)
    q, k, v = inputs(gen, 4, 2, 9, 33, 8)
    grad = torch.randn(1, 4, 9, 8, generator=gen, dtype=torch.float64)
    out = chain.ChainAttention.apply(q, k, v, 33, 0.4, kernel)
    ref = dense_reference(q, k, v, 33, 0.4)
    assert_rel(out, ref)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        assert_rel(got, want)


# ------------------------------------------------------------------ lengths on a grid
@pytest.mark.parametrize("align", [4, 16])
@pytest.mark.parametrize("prefix", [0, 1, 3, 16, 21, 45, 75, 300])
@pytest.mark.parametrize("n", [1, 5, 16, 17, 70])
def test_lengths_on_a_grid_are_exact(align, prefix, n, gen):
    """An aligned kernel's parts run on lengths that are multiples of ``align`` (never a key
    length of 1: cuDNN's limits), and the chain attention stays exact: moved prefix keys,
    dummy rows and zero keys change no output or gradient."""
    heads, kv_heads, dim = 4, 2, 8
    calls = []
    for expand_kv in (False, True):
        kernel = recording(chain.Kernel("math", chain._math_forward, chain._math_backward, expand_kv, align), calls)
        q, k, v = inputs(gen, heads, kv_heads, n, prefix, dim)
        q = (2 * q).detach().requires_grad_()
        grad = torch.randn(1, heads, n, dim, generator=gen, dtype=torch.float64)
        out = chain.ChainAttention.apply(q, k, v, prefix, 0.45, kernel)
        ref = dense_reference(q, k, v, prefix, 0.45)
        assert out.shape == ref.shape
        assert_rel(out, ref)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), grad)):
            assert got.shape == want.shape
            assert_rel(got, want)
    assert calls and all(nq % align == 0 and nk % align == 0 and nk >= align for nq, nk, _ in calls), calls
    layout = plans.Layout.of(n, prefix, align)
    assert layout.padded == (n % align != 0 or prefix % align != 0)
    assert layout.rows - n < 2 * align and layout.full_keys + layout.front == prefix


def test_lengths_on_the_grid_already_run_as_they_are(gen):
    """Prefix and queries already multiples of the grid (a long prompt's 2,048-token pieces):
    no padding, the kernels get the inputs themselves."""
    calls = []
    kernel = recording(chain.Kernel("math", chain._math_forward, chain._math_backward, align=8), calls)
    q, k, v = inputs(gen, 4, 2, 16, 24, 8)
    out, lse, extras = chain.chain_forward(kernel, q.detach(), k.detach(), v.detach(), 24, 0.5)
    assert not extras.layout.padded and extras.out is None
    assert sorted(calls) == [(16, 16, True), (16, 24, False)]


def test_fused_kernels_head_limits():
    """The rule that keeps the aten ops away from heads they do not take (torch's own SDPA
    dispatch checks these before it calls a kernel; the probe never calls a refused one)."""
    assert chain.refuses("cudnn", 16, 8, 128) is None and chain.refuses("flash", 16, 8, 256) is None
    assert "head dim 256" in chain.refuses("cudnn", 16, 8, 256)
    assert "head dim 100" in chain.refuses("flash", 16, 8, 100)
    assert "heads over" in chain.refuses("efficient", 6, 4, 64)
    assert chain.refuses("a test's kernel", 16, 8, 7) is None
    kernel, errors = chain.probe("meta", torch.bfloat16, 16, 8, 200, names=("cudnn",))
    assert kernel is None and errors == ["cudnn: refuses head dim 200 (takes multiples of 8 up to 128)"]
    assert chain.fused_kernel("cudnn").align == 128 and chain.fused_kernel("flash").align == 1


@pytest.fixture
def cudnn_state(monkeypatch):
    """The module's shape records and engine-call counts, fresh for the test and restored after it."""
    for name, value in (("SHAPES", {}), ("_call_depth", 0), ("_call_new_shapes", 0), ("_call_deferred", False)):
        monkeypatch.setattr(plans, name, value)
    return monkeypatch


def fake_kernels():
    """A "cudnn" kernel on a grid of 4 and a "flash" fallback, both the plain-torch math."""
    return (chain.Kernel("cudnn", chain._math_forward, chain._math_backward, align=4),
            chain.Kernel("flash", chain._math_forward, chain._math_backward))


def test_cudnn_shapes_bounded(gen, cudnn_state):
    """Past CUDNN_MAX_SHAPES distinct (rows, prefix keys) shapes, a new shape takes the
    fallback kernel; a shape cuDNN has planned keeps cuDNN (the same kernel every time, so a
    recompute matches its forward)."""
    cudnn_state.setattr(plans, "CUDNN_MAX_SHAPES", 2)
    cudnn_state.setattr(plans, "CUDNN_NEW_SHAPES_PER_CALL", None)
    cudnn, flash = fake_kernels()

    def pick(n, prefix):
        q, k, _ = inputs(gen, 2, 1, n, prefix, 4)
        return plans.planned(cudnn, q, k, lambda: flash).name

    assert [pick(3, 5), pick(4, 4), pick(2, 6)] == ["cudnn", "cudnn", "cudnn"]  # one shape: 4 rows after 4 keys
    assert pick(1, 8) == "cudnn"  # a second shape: 4 rows after 8 keys
    assert [pick(5, 8), pick(3, 5), pick(1, 9)] == ["flash", "cudnn", "cudnn"]
    assert {k: len(v) for k, v in plans.SHAPES.items()} == {"cudnn": 2, "flash": 1}
    cudnn_state.setattr(plans, "CUDNN_MAX_SHAPES", None)
    assert pick(5, 8) == "cudnn"


def test_cudnn_new_shapes_bounded_per_engine_call(gen, cudnn_state):
    """At most CUDNN_NEW_SHAPES_PER_CALL new shapes an engine call: the call's other new shapes take the
    fallback, and keep it for the rest of the call (a recompute matches its forward), recorded as deferred;
    the next call plans them. plans_room counts the call's allowance left. A call inside another shares
    the outermost's allowance and does not end it; outside any call only the process's bound holds."""
    cudnn_state.setattr(plans, "CUDNN_MAX_SHAPES", None)
    cudnn_state.setattr(plans, "CUDNN_NEW_SHAPES_PER_CALL", 2)
    cudnn, flash = fake_kernels()
    heads = (torch.device("cpu"), torch.float64, 2, 1, 4)

    def pick(n, prefix):
        q, k, _ = inputs(gen, 2, 1, n, prefix, 4)
        return plans.planned(cudnn, q, k, lambda: flash).name

    with plans.engine_call():
        assert [pick(3, 0), pick(3, 4)] == ["cudnn", "cudnn"] and not plans.call_deferred()
        assert plans.plans_room(cudnn, *heads, [(3, 0, True), (3, 4, True)])  # planned already
        assert not plans.call_deferred()
        assert not plans.plans_room(cudnn, *heads, [(3, 0, True), (3, 8, True)])  # one new: none left
        assert plans.call_deferred()
        with plans.engine_call():  # nested (a loss running an engine call): the same allowance
            assert [pick(3, 8), pick(3, 12)] == ["flash", "flash"]
        assert [pick(3, 8), pick(3, 0), pick(3, 4)] == ["flash", "cudnn", "cudnn"]  # still the same call
    assert plans.call_deferred()  # (readable after the call)
    with plans.engine_call():  # the next call
        assert not plans.call_deferred()
        assert plans.plans_room(cudnn, *heads, [(3, 8, True), (3, 12, True)])
        assert not plans.plans_room(cudnn, *heads, [(3, 8, True), (3, 12, True), (3, 16, True)])
        assert [pick(3, 12), pick(3, 8), pick(3, 16), pick(3, 0)] == ["cudnn", "cudnn", "flash", "cudnn"]
    with plans.engine_call():
        assert pick(3, 16) == "cudnn" and len(plans.SHAPES["cudnn"]) == 5 and not plans.call_deferred()
    cudnn_state.setattr(plans, "CUDNN_MAX_SHAPES", 7)  # the process's bound holds across calls, and outside them
    assert [pick(3, 20), pick(3, 24), pick(3, 28)] == ["cudnn", "cudnn", "flash"]
    with plans.engine_call():
        assert pick(3, 32) == "flash" and not plans.plans_room(cudnn, *heads, [(3, 32, True)])
        assert not plans.call_deferred()  # (the process's bound, not the call's)


def test_engine_calls_are_one_cudnn_allowance_each(cudnn_state):
    """Every engine forward and forward_backward runs inside one engine call (its loss and backward included),
    closed also when the loss raises."""
    depths = []

    def loss(lps):
        depths.append(plans._call_depth)
        return sum(lp.sum() for lp in lps)

    model = get_model(dtype=torch.float64)
    engine = treerl.TreeEngine(model, "auto", compile=False)
    seqs = [random_seq(torch.Generator().manual_seed(1), 12, model.config.vocab_size) for _ in range(2)]
    import treerl.engine.tree_engine as tree_engine

    counted = []

    def counting():
        counted.append(1)
        return plans.engine_call()

    cudnn_state.setattr(tree_engine, "engine_call", counting)
    engine.logprobs(seqs)
    engine.forward_backward(seqs, loss)
    assert len(counted) == 2
    assert depths == [1] and plans._call_depth == 0
    with pytest.raises(ValueError):
        engine.forward_backward(seqs, lambda lps: (_ for _ in ()).throw(ValueError("a loss that fails")))
    assert plans._call_depth == 0
    model.zero_grad(set_to_none=True)


def test_plans_room_says_what_planned_would_do(gen, cudnn_state):
    """plans_room (the engine's check before a root split) is True exactly where planned would keep
    cuDNN for every part of a call: shapes it has planned, or room under CUDNN_MAX_SHAPES for all the
    new ones together; it records no shape; any other kernel has no bound."""
    cudnn_state.setattr(plans, "CUDNN_MAX_SHAPES", 2)
    cudnn_state.setattr(plans, "CUDNN_NEW_SHAPES_PER_CALL", None)
    cudnn, flash = fake_kernels()
    q, k, _ = inputs(gen, 2, 1, 3, 5, 4)
    heads = (q.device, q.dtype, 2, 1, 4)
    parts = [(3, 5, True), (6, 8, False)]  # 4 rows after 4 keys (causal); 8 rows after 8 keys (full)
    assert plans.plans_room(cudnn, *heads, parts) and plans.SHAPES == {}
    assert not plans.plans_room(cudnn, *heads, parts + [(9, 0, True)])  # three new shapes, room for two
    plans.planned(cudnn, q, k, lambda: flash)  # the first part's shape planned
    assert plans.plans_room(cudnn, *heads, parts) and plans.plans_room(cudnn, *heads, [(9, 0, True)])
    assert not plans.plans_room(cudnn, *heads, [(9, 0, True), (13, 0, True)])
    assert plans.plans_room(flash, *heads, [(9, 0, True), (13, 0, True)])
    cudnn_state.setattr(plans, "CUDNN_MAX_SHAPES", None)
    assert plans.plans_room(cudnn, *heads, [(9, 0, True), (13, 0, True)])


# ------------------------------------------------------------------------ the probe
def _broken(kind):
    def forward(q, k, v, causal, scale):
        if kind == "raises":
            raise RuntimeError("No available kernel. Aborting execution.")
        if kind == "no-gqa" and k.shape[1] != q.shape[1]:
            raise RuntimeError("number of heads in key/value must equal query's")
        out, lse, extra = chain._math_forward(q, k, v, causal, scale)
        return out, (lse / torch.log(torch.tensor(2.0, dtype=lse.dtype)) if kind == "log2" else lse), extra

    def backward(dout, q, k, v, out, lse, extra, causal, scale):
        if kind == "no-gqa" and k.shape[1] != q.shape[1]:
            raise RuntimeError("number of heads in key/value must equal query's")
        return chain._math_backward(dout, q, k, v, out, lse, extra, causal, scale)

    return forward, backward


def test_probe_takes_the_first_kernel_that_is_right():
    fused = {name: _broken(name) for name in ("raises", "log2", "no-gqa")}
    kernel, errors = chain.probe("cpu", torch.float64, 4, 2, 16, ("raises", "log2", "no-gqa"), fused)
    assert kernel.name == "no-gqa" and kernel.expand_kv  # GQA refused: K/V heads repeated
    assert any("raises" in e and "No available kernel" in e for e in errors), errors
    assert any("log2" in e and "differs from the float32 math" in e for e in errors), errors
    kernel, _ = chain.probe("cpu", torch.float64, 4, 4, 16, ("no-gqa",), fused)
    assert kernel.name == "no-gqa" and not kernel.expand_kv
    kernel, errors = chain.probe("cpu", torch.float64, 4, 2, 16, ("raises", "log2", "nonesuch"), fused)
    assert kernel is None and len(errors) == 5 and "nonesuch: unknown" in errors


def test_no_kernel_warns_once_and_the_engine_masks(gen, monkeypatch):
    """Where no fused kernel takes the inputs, one warning, and the calls run with the tree mask, exactly."""
    fused = {"raises": _broken("raises")}
    monkeypatch.setattr(chain, "_chosen", {})
    with pytest.warns(RuntimeWarning, match="no fused SDPA kernel.*No available kernel"):
        assert chain.select("cpu", torch.float64, 4, 2, 16, ("raises",), fused) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chain.select("cpu", torch.float64, 4, 2, 16, ("raises",), fused) is None  # cached, silent

    prefixes = count_chain_calls(monkeypatch)  # the path on
    monkeypatch.setattr(attention, "kernel_for", lambda q, k: None)  # (attention imports the name)
    masked = []
    mask = attention.TreeAttention.mask
    monkeypatch.setattr(attention.TreeAttention, "mask", lambda self: masked.append(1) or mask(self))
    seqs = [random_seq(gen, 23), random_seq(gen, 9)]
    model = get_model("qwen3")
    engine = check_engine(model, seqs, "flat", RandomLoss.make(seqs, gen), max_tokens=6)
    assert masked and prefixes == []
    routes = engine.stats.attention
    assert routes["mask:no-kernel"] > 0 and not any(r.startswith("chain") for r in routes), routes


# ------------------------------------------------------------------ the engine
def count_chain_calls(monkeypatch) -> list[int]:
    """Prefix lengths of the chain attentions run (forward), with the path switched on (on the
    CPU it is off by default: treerl.engine.attention)."""
    monkeypatch.setattr(attention, "CHAIN_AFTER_PREFIX", True)
    prefixes = []
    apply = chain.ChainAttention.apply
    monkeypatch.setattr(chain.ChainAttention, "apply",
                        lambda q, k, v, prefix, *rest: prefixes.append(prefix) or apply(q, k, v, prefix, *rest))
    return prefixes


@pytest.mark.parametrize("mode,kw", [
    ("flat", dict(max_tokens=5)),
    ("dfs", dict(chunk_tokens=3)),
    ("auto", dict(max_tokens=7, chunk_tokens=3)),
])
@pytest.mark.parametrize("separable", [False, True])
@pytest.mark.parametrize("align", [1, 4], ids=["as-is", "grid4"])
def test_engine_exact_on_long_prefixes_split_in_pieces(mode, kw, separable, align, gen, monkeypatch):
    """A long shared prefix (and a long lone sequence) run as chain pieces, each after all the
    earlier pieces: exact with the chain attention, which ran after prefixes of many lengths
    (``grid4``: its kernel calls on lengths padded to multiples of 4, as cuDNN's to 128), and
    every layer call of a piece after a prefix took it (the engine's attention routes)."""
    prompt = random_seq(gen, 31)
    seqs = [prompt + random_seq(gen, 4), prompt + random_seq(gen, 6), random_seq(gen, 26)]
    model = get_model("qwen3")  # 4 query heads, 2 KV heads
    prefixes = count_chain_calls(monkeypatch)
    monkeypatch.setattr(chain, "MATH", chain.Kernel("math", chain._math_forward, chain._math_backward, align=align))
    engine = check_engine(model, seqs, mode, RandomLoss.make(seqs, gen), separable=separable, entropy=True, **kw)
    assert len({p for p in prefixes if p > 0}) >= 4, prefixes
    routes = engine.stats.attention  # (the last step's: forward_backward)
    assert routes["chain:math"] > 0 and not {"mask:chain-off", "mask:no-kernel"} & set(routes), routes


@pytest.mark.parametrize("variant", ["llama-tied-mha", "qwen2-tied-mqa"])
def test_engine_chain_pieces_with_kept_attention(variant, gen, monkeypatch):
    """Recomputed chain pieces that keep every layer's attention (their backward reads the
    recomputed q/k/v): exact."""
    monkeypatch.setattr(MemoryPolicy, "kept_attention_layers",
                        lambda self, queries, keys, copies, spare, **kw: frozenset(range(self.layers)))
    model = get_model(variant, num_hidden_layers=4)
    m = MemoryModel.estimate(model.config, torch.float64, dense_mask=True)
    budget = int(m.fixed + 12 * m.recompute_per_token + 12**2 * m.per_pair) + 1  # calls of up to 12 tokens
    prompt = random_seq(gen, 18)
    seqs = [prompt + random_seq(gen, 5), prompt + random_seq(gen, 3)]
    prefixes = count_chain_calls(monkeypatch)
    engine = check_engine(model, seqs, "auto", RandomLoss.make(seqs, gen), chunk_tokens=4, memory_budget=budget)
    assert engine.stats.kept_attention_layers > 0 and any(p > 0 for p in prefixes), (engine.stats, prefixes)


def test_switch_off_runs_the_tree_mask(gen, monkeypatch):
    prefixes = count_chain_calls(monkeypatch)
    monkeypatch.setattr(attention, "CHAIN_AFTER_PREFIX", False)  # (the default on the CPU)
    seqs = [random_seq(gen, 20)]
    engine = check_engine(get_model("qwen3"), seqs, "flat", RandomLoss.make(seqs, gen), max_tokens=6)
    assert prefixes == []
    routes = engine.stats.attention
    assert routes["mask:chain-off"] > 0 and routes["causal"] > 0 and not any(r.startswith("chain") for r in routes)


# the routes of a long prompt's pieces and groups, each switch off and on: tests/engine/test_group_attention.py


@pytest.mark.parametrize("name", chain.KERNELS)
@pytest.mark.parametrize("expand_kv", [False, True], ids=["gqa", "kv-expanded"])
def test_fused_kernel_calls_on_meta_tensors(name, expand_kv):
    """The aten ops take the arguments as chain_attention passes them (order, types) and
    their outputs unpack as it reads them: run through their meta kernels, no GPU needed
    (the values: tests/cuda/test_chain_attention_cuda.py)."""
    kernel = chain.fused_kernel(name, expand_kv)  # cuDNN's on lengths padded to its grid
    q = torch.empty(1, 77, 16, 128, device="meta", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.empty(1, 8, 131 + 77, 128, device="meta", dtype=torch.bfloat16) for _ in range(2))
    out, lse, extras = chain.chain_forward(kernel, q, k, v, 131, 128 ** -0.5)
    assert out.shape == q.shape and chain.lse_rows(lse, 77).shape == (1, 16, 77)
    dq, dk, dv = chain.chain_backward(kernel, torch.empty_like(out), q, k, v, out, lse, extras, 131, 128 ** -0.5)
    assert dq.shape == q.shape
    if expand_kv or name != "efficient":  # (the memory-efficient kernel has no GQA: the probe rejects its dK shape)
        assert dk.shape == k.shape and dv.shape == v.shape
