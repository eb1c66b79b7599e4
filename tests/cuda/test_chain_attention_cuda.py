"""Chain attention after a prefix on the GPU (treerl.engine.chain_attention): each fused SDPA
kernel's merged output and gradients against float64, and the engine with the path on
against the tree mask (off), both against a float32 per-sequence reference.

The kernels run as the engine runs them (``chain.fused_kernel``): cuDNN's calls on lengths
padded to multiples of 128 (``plans.Layout``: never a key length of 1, never a length off
its grid, the shapes that once crashed this file's process), which the tests check call by
call; heads a kernel does not take (``chain.refuses``) are never handed to it.

Groups of leaves after a prefix (treerl.engine.group_attention) the same way: each fused
kernel's full part over the prefix merged with compiled flex's own part (its log-sum-exp
differentiated), against float64; the engine with GROUPS_AFTER_PREFIX on against off. The root
split (ROOT_SPLIT: a root chain's causal fused kernel, the rest as a group after it) against float64.

Skipped on machines without a GPU; run on the device machine."""

import collections
import functools

import pytest
import torch

import treerl
import treerl.engine.attention as attention
import treerl.engine.chain_attention as chain
import treerl.engine.kernel_plans as plans
import treerl.engine.group_attention as group
from treerl import PrefixTree
from treerl.devtools.workloads import SCALES, make_workload
from treerl.models import build_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEADS, KV_HEADS, DIM = 16, 8, 128  # Qwen3-1.7B


def rel(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def recording(kernel: chain.Kernel, calls: list) -> chain.Kernel:
    """``kernel`` noting the (queries, keys) of each of its part calls, before the call."""

    def forward(q, k, v, causal, scale):
        calls.append((q.shape[2], k.shape[2]))
        return kernel.forward(q, k, v, causal, scale)

    def backward(dout, q, k, v, out, lse, extra, causal, scale):
        calls.append((q.shape[2], k.shape[2]))
        return kernel.backward(dout, q, k, v, out, lse, extra, causal, scale)

    return chain.Kernel(kernel.name, forward, backward, kernel.expand_kv, kernel.align)


def _bf16_inputs(n: int, keys: int, seed: int, grad: bool = True):
    """Random bf16 CUDA q [1, HEADS, n, DIM] (the engine's transposed layout), k/v [1, KV_HEADS,
    keys, DIM] (requiring grad with ``grad``) and an output gradient like q."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, HEADS, DIM, generator=gen).transpose(1, 2).to("cuda", torch.bfloat16)
    k, v = (torch.randn(1, KV_HEADS, keys, DIM, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    dout = torch.randn(1, n, HEADS, DIM, generator=gen).transpose(1, 2).to("cuda", torch.bfloat16)
    return (*(x.requires_grad_(grad) for x in (q, k, v)), dout)


@pytest.mark.parametrize("n,prefix", [(1, 1), (77, 0), (77, 1), (200, 333), (256, 1024), (384, 2048), (1, 127)])
@pytest.mark.parametrize("expand_kv", [False, True], ids=["gqa", "kv-expanded"])
@pytest.mark.parametrize("name", chain.KERNELS)
def test_fused_kernels_against_float64(name, expand_kv, n, prefix):
    """bf16 kernel, merged in float32, against the float64 math on the same (bf16) inputs:
    within bf16 rounding (~1e-2 of the largest value), where a wrong merge or log-sum-exp
    convention is off by O(1). cuDNN's calls on its grid of 128. A kernel that refuses the
    inputs (an exception, e.g. no GQA) is skipped, saying why."""
    assert chain.refuses(name, HEADS, KV_HEADS, DIM) is None
    calls = []
    kernel = recording(chain.fused_kernel(name, expand_kv), calls)
    q, k, v, dout = _bf16_inputs(n, prefix + n, n + prefix, grad=False)
    scale = DIM ** -0.5
    try:
        out, lse, extras = chain.chain_forward(kernel, q, k, v, prefix, scale)
        grads = chain.chain_backward(kernel, dout, q, k, v, out, lse, extras, prefix, scale)
    except RuntimeError as exc:
        pytest.skip(f"{name} refuses these inputs: {str(exc).splitlines()[0][:200]}")
    f64 = [x.double() for x in (q, k, v, dout)]
    ref_out, ref_lse, ref_extras = chain.chain_forward(chain.MATH, *f64[:3], prefix, scale)
    ref = chain.chain_backward(chain.MATH, f64[3], *f64[:3], ref_out, ref_lse, ref_extras, prefix, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert rel(out, ref_out) < 1e-2
    assert float((chain.lse_rows(lse, n).double() - ref_lse).abs().max()) < 1e-3  # float32 statistics
    for what, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert got.shape == want.shape and rel(got, want) < 2e-2, (what, rel(got, want))
    align = chain.ALIGN.get(name, 1)
    assert calls and all(nq % align == 0 and nk % align == 0 and nk >= align for nq, nk in calls), calls


def test_probe_picks_a_fused_kernel_for_qwen3_heads():
    q = torch.zeros(1, HEADS, 8, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(1, KV_HEADS, 16, DIM, device="cuda", dtype=torch.bfloat16)
    kernel = chain.kernel_for(q, k)
    print(f"chain attention probe: {chain.PROBED}")
    assert kernel is not None and kernel.name in chain.KERNELS
    print(f"chain attention kernel: {kernel.label}")
    assert chain.kernel_for(q.float(), k.float()) is None  # float32: the tree mask, by design


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="cuDNN's SDPA is the fast one on sm90 (H100/H200)")
def test_probe_takes_cudnn_on_hopper():
    """On its grid cuDNN passes the probe (its odd shapes once sent it below flash)."""
    kernel, errors = chain.probe(torch.device("cuda"), torch.bfloat16, HEADS, KV_HEADS, DIM, names=("cudnn",))
    assert kernel is not None and kernel.name == "cudnn", errors


def _logprobs_and_grads(model, engine, seqs, weights):
    model.zero_grad()
    lps = engine.logprobs(seqs)
    engine.forward_backward(seqs, lambda lps: sum((lp.double() * w).sum() for lp, w in zip(lps, weights)))
    return [lp.double() for lp in lps], {n: p.grad.double().clone() for n, p in model.named_parameters()}


def _long_prefix_and_float32_reference():
    """The small-scale long_prefix workload, per-token weights, a bf16 ``small`` Qwen3 and its
    float32 per-sequence reference (same weights): ``(seqs, weights, model, ref_lps, ref_grads)``."""
    seqs = [torch.as_tensor(s) for s in make_workload("long_prefix", SCALES["small"], 4096, seed=3)]
    weights = [torch.randn(len(s) - 1, device="cuda", dtype=torch.float64) for s in seqs]
    model = build_model("qwen3", "small", dtype=torch.bfloat16, device="cuda", seed=1)
    ref_model = build_model("qwen3", "small", dtype=torch.float32, device="cuda", seed=1)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # the same weights
    ref_lps = []
    for s in seqs:
        logits = ref_model(input_ids=s[None].cuda()).logits[0].double()
        ref_lps.append(torch.log_softmax(logits[:-1], -1).gather(1, s[1:, None].cuda())[:, 0])
    sum((lp * w).sum() for lp, w in zip(ref_lps, weights)).backward()
    ref_grads = {n: p.grad.double() for n, p in ref_model.named_parameters()}
    return seqs, weights, model, [lp.detach() for lp in ref_lps], ref_grads


def _errors(lps, grads, ref_lps, ref_grads) -> tuple[float, float]:
    """Max |logprob error| and max relative gradient error (per parameter) against the reference."""
    return (max(float((a - b).abs().max()) for a, b in zip(lps, ref_lps)),
            max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items()))


@pytest.mark.parametrize("mode,kw", [("flat", {"max_tokens": 256}), ("dfs", {"chunk_tokens": 200}),
                                     ("auto", {"max_tokens": 300, "chunk_tokens": 64})])
def test_engine_bf16_chain_path_as_accurate_as_the_tree_mask(mode, kw, monkeypatch):
    """bf16 engine on a long shared prefix split in chain pieces: with the chain attention its
    logprobs and gradients are as close to the float32 per-sequence reference as with the
    tree mask (flex), and the pieces did run through it."""
    seqs, weights, model, ref_lps, ref_grads = _long_prefix_and_float32_reference()

    prefixes = []
    apply = chain.ChainAttention.apply
    monkeypatch.setattr(chain.ChainAttention, "apply",
                        lambda q, k, v, prefix, *rest: prefixes.append(prefix) or apply(q, k, v, prefix, *rest))
    errors, routes = {}, {}
    for on in (False, True):
        monkeypatch.setattr(attention, "CHAIN_AFTER_PREFIX", on)
        engine = treerl.TreeEngine(model, mode, attention="flex", compile=False, **kw)  # blocks eager: attention only
        errors[on] = _errors(*_logprobs_and_grads(model, engine, seqs, weights), ref_lps, ref_grads)
        routes[on] = dict(engine.stats.attention)
        assert bool(prefixes) == on and (not on or max(prefixes) > 0), prefixes
        chained = sum(v for r, v in routes[on].items() if r.startswith("chain:"))
        assert (chained > 0 and "mask:no-kernel" not in routes[on]) if on else chained == 0, routes[on]
    print("attention layer calls by route (the last forward_backward): tree mask", routes[False], "chain", routes[True])
    print("max |logprob error|, max relative gradient error: tree mask", errors[False], "chain", errors[True])
    assert errors[True][0] <= 1.5 * errors[False][0] + 1e-2, errors
    assert errors[True][1] <= 1.5 * errors[False][1] + 1e-2, errors


# ------------------------------------------------------------- groups after a prefix
def _group_tree(prefix: int, lengths: list[int], stem: int, seed: int):
    """q_index, k_index, k_end (CUDA) of responses of ``lengths`` after a ``prefix``-token
    prompt, the first two sharing a ``stem`` (a small tree below the prompt)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(0, 1000, (n,), generator=gen).tolist()  # noqa: E731
    prompt, shared = tokens(prefix), tokens(stem)
    seqs = [prompt + (shared if i < 2 else []) + tokens(n) for i, n in enumerate(lengths)]
    tree = PrefixTree.from_sequences(seqs)
    k_index = torch.arange(tree.num_tree_tokens, device="cuda")
    return k_index[prefix:], k_index, tree.subtree_end.to("cuda")[k_index]


class Refused(Exception):
    """A fused kernel's RuntimeError (inputs it does not take)."""


def _refusals_noted(kernel: chain.Kernel) -> chain.Kernel:
    """``kernel`` raising :class:`Refused` where it raises a RuntimeError."""

    def noted(fn):
        def call(*args):
            try:
                return fn(*args)
            except RuntimeError as exc:
                raise Refused(str(exc)) from exc
        return call

    return chain.Kernel(kernel.name, noted(kernel.forward), noted(kernel.backward), kernel.expand_kv, kernel.align)


@pytest.mark.parametrize("prefix,lengths", [(131, [40, 37, 77, 9]), (1024, [100, 60, 96]), (2048, [64, 64, 64, 40]),
                                            (127, [30, 30])])
@pytest.mark.parametrize("expand_kv", [False, True], ids=["gqa", "kv-expanded"])
@pytest.mark.parametrize("name", chain.KERNELS)
def test_group_fused_kernels_against_float64(name, expand_kv, prefix, lengths):
    """bf16: the fused kernel's full part (cuDNN's on its grid of 128: dummy rows after the
    queries, ``prefix % 128`` keys moved to flex's part) merged with compiled flex's tree-masked
    own part, forward and backward (through flex's log-sum-exp), against float64 attention with
    the dense tree mask on the same bf16 inputs: within bf16 rounding. A kernel that refuses
    the inputs is skipped, saying why; a prefix under cuDNN's grid runs no group (None)."""
    calls = []
    kernel = recording(_refusals_noted(chain.fused_kernel(name, expand_kv)), calls)
    q_index, k_index, k_end = _group_tree(prefix, lengths, 5, prefix + len(lengths))
    ctx = attention.TreeAttention("flex", q_index, k_index, k_end)  # (its own masks)
    n, keys = len(q_index), len(k_index)
    q, k, v, dout = _bf16_inputs(n, keys, n + prefix)
    scale = DIM ** -0.5
    try:
        out = group.group_attention(q, k, v, scale, functools.partial(attention._own, ctx), kernel)
        if out is None:
            assert prefix < chain.ALIGN.get(name, 1) and calls == []
            return
        grads = torch.autograd.grad(out, (q, k, v), dout)
    except Refused as exc:  # (the kernel's; flex's errors fail the test)
        pytest.skip(f"{name} refuses these inputs: {str(exc).splitlines()[0][:200]}")
    _assert_near_float64(out, grads, q, k, v, attention.dense_tree_mask(q_index, k_index, k_end), scale, dout)
    align = chain.ALIGN.get(name, 1)
    assert calls and all(nq % align == 0 and nk % align == 0 and nk >= align for nq, nk in calls), calls


def _assert_near_float64(out, grads, q, k, v, visible, scale, dout):
    """bf16 ``out`` and its q/k/v ``grads`` against float64 attention with the dense mask ``visible``
    on the same inputs: within bf16 rounding."""
    f64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    s = (f64[0] @ f64[1].repeat_interleave(HEADS // KV_HEADS, 1).transpose(-1, -2) * scale).masked_fill(
        ~visible, float("-inf"))
    ref = torch.softmax(s, -1) @ f64[2].repeat_interleave(HEADS // KV_HEADS, 1)
    ref_grads = torch.autograd.grad(ref, f64, dout.double())
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert rel(out.detach(), ref.detach()) < 1e-2
    for what, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert got.shape == want.shape and rel(got, want) < 2e-2, (what, rel(got, want))


@pytest.mark.parametrize("root,lengths", [(1024, [100, 60, 96]), (2000, [64, 64, 40])])
def test_root_split_bf16_against_float64(root, lengths, monkeypatch):
    """bf16 root split (ROOT_SPLIT): the probed fused kernel on the root chain (causal), the fused kernel's
    full part and compiled flex's own part on the rest, forward and backward, against float64
    attention with the dense tree mask: within bf16 rounding; the route says it ran."""
    monkeypatch.setattr(attention, "ROOT_SPLIT", True)
    monkeypatch.setattr(attention, "ROOT_SPLIT_MIN_TOKENS", 512)
    _, _, k_end = _group_tree(root, lengths, 5, root + 7)
    roots = _root_split_near_float64(k_end, root)
    assert len(roots) == 1 and roots[0].root >= root


def _root_split_near_float64(k_end: torch.Tensor, seed: int) -> tuple:
    """The root split of one call (subtree ends ``k_end`` on CUDA, its trees by ``rooted_trees``) on
    random bf16 inputs: output and q/k/v gradients within bf16 rounding of float64 through the dense
    tree mask, its route counted once as ``root:``; its trees."""
    from treerl.engine.rooted_trees import rooted_trees

    index = torch.arange(len(k_end), device="cuda")
    roots = rooted_trees(k_end.cpu(), 0)
    ctx = attention.TreeAttention("flex", index, index, k_end, roots=roots)
    ctx.routes = collections.Counter()
    assert ctx.roots == roots
    n = len(index)
    q, k, v, dout = _bf16_inputs(n, n, n + seed)
    scale = DIM ** -0.5
    out = attention._attend(ctx, q, k, v, scale)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _assert_near_float64(out, grads, q, k, v, attention.dense_tree_mask(index, index, k_end), scale, dout)
    assert len(ctx.routes) == 1 and next(iter(ctx.routes)).startswith("root:"), ctx.routes
    return roots


def test_root_split_of_two_trees_bf16_against_float64(monkeypatch):
    """bf16 root split of a call of two trees (ROOT_SPLIT_MAX_TREES raised; the workload ``long``'s
    shape, smaller): per tree the fused causal kernel on its root chain, the fused kernel's full part and
    compiled flex's own part on the tree's block, against float64 with the dense tree mask."""
    monkeypatch.setattr(attention, "ROOT_SPLIT", True)
    monkeypatch.setattr(attention, "ROOT_SPLIT_MIN_TOKENS", 512)
    monkeypatch.setattr(attention, "ROOT_SPLIT_MAX_TREES", 2)
    _, _, end_a = _group_tree(1000, [100, 60, 96], 5, 11)
    _, _, end_b = _group_tree(700, [64, 64, 40], 3, 12)
    roots = _root_split_near_float64(torch.cat([end_a, end_b + len(end_a)]), 13)  # the second tree after the first
    assert len(roots) == 2 and all(t.root >= 700 and t.rest for t in roots)


def test_group_float32_takes_the_tree_mask(monkeypatch):
    """float32 on CUDA: no fused kernel (the tree mask is exact there), the route says so."""
    monkeypatch.setattr(attention, "GROUPS_AFTER_PREFIX", True)
    q_index, k_index, k_end = _group_tree(256, [20, 30], 4, 0)
    kv = [[(torch.zeros(1, KV_HEADS, 256, DIM, device="cuda"),) * 2]]
    ctx = attention.TreeAttention("flex", q_index, k_index, k_end, prefix=kv)
    q, k = torch.zeros(1, HEADS, len(q_index), DIM, device="cuda"), torch.zeros(1, KV_HEADS, len(k_index), DIM,
                                                                               device="cuda")
    assert ctx.group and chain.kernel_for(q, k, causal=False) is None
    assert attention._group(ctx, q, k, k, None) is None and ctx.routes is None
    assert attention.ROUTES["mask:no-kernel"] > 0


@pytest.mark.parametrize("chains", [False, True], ids=["chain-off", "chain-on"])
def test_engine_bf16_group_path_as_accurate_as_the_tree_mask(chains, monkeypatch):
    """bf16 engine (auto) on a long shared prefix whose responses run as a group after it:
    with the group attention its logprobs and gradients are as close to the float32
    per-sequence reference as with the tree mask (flex), and the group did run through it."""
    seqs, weights, model, ref_lps, ref_grads = _long_prefix_and_float32_reference()

    monkeypatch.setattr(attention, "CHAIN_AFTER_PREFIX", chains)
    errors, routes = {}, {}
    for on in (False, True):
        monkeypatch.setattr(attention, "GROUPS_AFTER_PREFIX", on)
        engine = treerl.TreeEngine(model, "auto", attention="flex", compile=False, max_tokens=300, chunk_tokens=64)
        errors[on] = _errors(*_logprobs_and_grads(model, engine, seqs, weights), ref_lps, ref_grads)
        routes[on] = dict(engine.stats.attention)
        grouped = sum(v for r, v in routes[on].items() if r.startswith("group:"))
        assert (grouped > 0 and "mask:no-kernel" not in routes[on]) if on else grouped == 0, routes[on]
    print("attention layer calls by route (the last forward_backward): tree mask", routes[False], "group", routes[True])
    print("max |logprob error|, max relative gradient error: tree mask", errors[False], "group", errors[True])
    assert errors[True][0] <= 1.5 * errors[False][0] + 1e-2, errors
    assert errors[True][1] <= 1.5 * errors[False][1] + 1e-2, errors


def test_engine_bf16_root_split_as_accurate_as_the_tree_mask(monkeypatch):
    """bf16 engine (auto) on a long shared prefix run as one call (its 512-token root chain, then
    its responses): with the root split its logprobs and gradients are as close to the float32
    per-sequence reference as with the tree mask (flex), and the split did run. (Kept attentions
    with the split: the CPU's float64 tests, tests/engine/test_root_split.py.)"""
    seqs, weights, model, ref_lps, ref_grads = _long_prefix_and_float32_reference()
    monkeypatch.setattr(attention, "ROOT_SPLIT_MIN_TOKENS", 256)
    errors, routes = {}, {}
    for on in (False, True):
        monkeypatch.setattr(attention, "ROOT_SPLIT", on)
        engine = treerl.TreeEngine(model, "auto", attention="flex", compile=False, max_tokens=4096)  # one call
        errors[on] = _errors(*_logprobs_and_grads(model, engine, seqs, weights), ref_lps, ref_grads)
        routes[on] = dict(engine.stats.attention)
        split = sum(v for r, v in routes[on].items() if r.startswith("root:"))
        assert (split > 0 and not any(r.startswith("mask") for r in routes[on])) if on else split == 0, routes[on]
        assert engine.stats.model_calls == 1, engine.stats
    print("attention layer calls by route (the last forward_backward): tree mask", routes[False], "root split",
          routes[True])
    print("max |logprob error|, max relative gradient error: tree mask", errors[False], "root split", errors[True])
    assert errors[True][0] <= 1.5 * errors[False][0] + 1e-2, errors
    assert errors[True][1] <= 1.5 * errors[False][1] + 1e-2, errors


def test_engine_keeps_the_padded_mask_past_cudnns_shape_bound(monkeypatch):
    """Where cuDNN may plan no new shape (CUDNN_MAX_SHAPES reached), the engine does not split a call
    (its parts would take flash's kernel, slower than the padded tree mask): the mask, no root route."""
    seqs, weights, model, _, _ = _long_prefix_and_float32_reference()
    monkeypatch.setattr(attention, "ROOT_SPLIT", True)
    monkeypatch.setattr(attention, "ROOT_SPLIT_MIN_TOKENS", 256)
    monkeypatch.setattr(plans, "SHAPES", {})
    monkeypatch.setattr(plans, "CUDNN_MAX_SHAPES", 0)
    engine = treerl.TreeEngine(model, "auto", attention="flex", compile=False, max_tokens=4096)  # one call
    _logprobs_and_grads(model, engine, seqs, weights)
    routes = dict(engine.stats.attention)
    assert not any(r.startswith("root:") for r in routes) and routes.get("mask", 0) > 0, routes
