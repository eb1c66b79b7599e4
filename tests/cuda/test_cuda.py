"""CUDA paths (compiled flex attention): exactness against a per-sequence forward.

Skipped on machines without a GPU; run on the device machine."""

import pytest
import torch

import treerl
from treerl.models import build_model
from helpers.forests import rows_token_grad, tree_sizes
from treerl.devtools.workloads import SCALES, make_workload

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def reference_logprobs(model, seqs):
    out = []
    for s in seqs:
        logits = model(input_ids=s[None].cuda()).logits[0].double()
        out.append(torch.log_softmax(logits[:-1], -1).gather(1, s[1:, None].cuda())[:, 0])
    return out


@pytest.mark.parametrize("mode,kw", [
    ("flat", {}), ("packed", {}), ("dfs", {"chunk_tokens": 7}), ("auto", {"max_tokens": 40, "chunk_tokens": 16}),
])
@pytest.mark.parametrize("workload", ["grpo", "agentic"])
@pytest.mark.parametrize("separable", [False, True, "tokens"])
def test_flex_float32_matches_per_sequence(mode, kw, workload, separable):
    """Every mode against the per-sequence forward; ``separable``: the loss in parts (chained
    plans: the one pass, treerl.engine.one_pass), else all at once (two phases); ``"tokens"``:
    a sum of per-token terms offering ``token_loss`` (single-level calls: the fused head)."""
    model = build_model("qwen3", "tiny", dtype=torch.float32, device="cuda", seed=1)
    seqs = [torch.as_tensor(s) for s in make_workload(workload, SCALES["tiny"], 512, seed=3)]
    weights = [torch.randn(len(s) - 1, device="cuda", dtype=torch.float64) for s in seqs]

    def loss_fn(lps, index=None):
        which = range(len(seqs)) if index is None else index.tolist()
        if separable == "tokens":
            return sum((lp.double() * weights[i] + 0.1 * lp.double().exp()).sum() for lp, i in zip(lps, which))
        return sum((lp.double() * weights[i]).sum() + 0.1 * lp.double().mean().exp() for lp, i in zip(lps, which))

    if separable == "tokens":
        flat = torch.cat(weights)
        loss_fn.token_loss = lambda lp, ent, tokens: (lp.double() * flat[tokens] + 0.1 * lp.double().exp()).sum()
    model.zero_grad()
    ref = reference_logprobs(model, seqs)
    loss_fn(ref).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine = treerl.TreeEngine(model, mode, attention="flex", **kw)
    assert engine.attention == "flex"
    lps = engine.logprobs(seqs)
    for a, b in zip(lps, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    model.zero_grad()
    engine.forward_backward(seqs, loss_fn, separable=bool(separable))
    for n, p in model.named_parameters():
        err = (p.grad - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)
        assert err < 1e-5, (n, float(err))


@pytest.mark.parametrize("fused", [False, True], ids=["recomputing-head", "fused-head"])
@pytest.mark.parametrize("mode,workload,many", [("packed", "none", (160, 160)), ("dfs", "grpo", (128, 64))])
def test_no_host_sync_per_segment(mode, workload, many, fused):
    """Host synchronisations of a step must not grow with the number of segments: count
    them (torch's sync debug mode warns on each) for a plan of 2 and of ~20 segments."""
    import warnings

    model = build_model("qwen3", "tiny", dtype=torch.float32, device="cuda", seed=1)
    seqs = [torch.as_tensor(s) for s in make_workload(workload, SCALES["small"], 512, seed=3)]
    weights = torch.randn(sum(len(s) - 1 for s in seqs), device="cuda")

    def loss_fn(lps, index=None):
        return (torch.cat(lps) * weights[: sum(len(lp) for lp in lps)]).sum()

    if fused:  # (a loss of per-token terms: the head takes its gradients per chunk, asking token_loss)
        loss_fn.token_loss = lambda lp, ent, tokens: (lp * weights[tokens]).sum()

    def syncs(max_tokens, chunk_tokens):
        engine = treerl.TreeEngine(model, mode, max_tokens=max_tokens, chunk_tokens=chunk_tokens, attention="flex")
        engine.forward_backward(seqs, loss_fn, separable=True)  # warm-up: compile
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.forward_backward(seqs, loss_fn, separable=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        calls = engine.stats.model_calls
        return sum("synchroniz" in str(w.message) for w in caught), calls

    few, few_calls = syncs(4096, 4096)
    many, many_calls = syncs(*many)
    assert many_calls >= 5 * few_calls
    assert many <= few + 2, (few, many)


@pytest.mark.parametrize("mode", ["packed", "auto", "flat"])
@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("keep", [0, 6], ids=["all-recomputed", "6-attentions-kept"])
def test_compiled_and_recomputed_blocks_float32(mode, compile, keep):
    """Compiled decoder blocks, recomputed in the backward under a small memory budget
    (the budget is set from the engine's own measured memory model). The ``small`` shape
    with 16 layers: on ``tiny`` (hidden 64) per-token memory is not the blocks'
    activations, and with 4 layers one block's activations held while it recomputes are
    more than recompute saves (H100, 2026-11-24: 852 kB/token recomputed vs 613 kB held):
    the memory model then rightly never recomputes. With ``keep``, the budget has room for
    the largest call's last ``keep`` layers to keep their attention (not recomputed)."""
    model = build_model("qwen3", "small", dtype=torch.float32, device="cuda", seed=2, num_hidden_layers=16)
    seqs = [torch.as_tensor(s) for s in make_workload("agentic", SCALES["tiny"], 512, seed=5)]
    weights = [torch.randn(len(s) - 1, device="cuda", dtype=torch.float64) for s in seqs]

    def loss_fn(lps):
        return sum((lp.double() * w).sum() for lp, w in zip(lps, weights))

    model.zero_grad()
    loss_fn(reference_logprobs(model, seqs)).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine = treerl.TreeEngine(model, mode, attention="flex", compile=compile)
    m = engine.memory.model
    assert m.measured and m.recompute_per_token < m.per_token
    # the largest tree fits one call only with its blocks recomputed (packed runs trees whole)
    largest = max(tree_sizes(treerl.PrefixTree.from_sequences([s.tolist() for s in seqs])))
    per_layer = largest * m.attention_per_query  # flex reads q/k/v as they are: only its output is held
    # half a layer: rounding (the budget still fits the largest tree with recompute)
    engine.memory.budget = int(m.fixed + largest * m.recompute_per_token + (keep + 0.5) * per_layer)
    assert engine.memory.recomputes(64)
    spare = engine.memory.budget - m.call_bytes(largest, recompute=True)
    assert len(engine.memory.kept_attention_layers(largest, largest, copies=False, spare=spare)) == keep  # flex, no prefix
    model.zero_grad()
    engine.forward_backward(seqs, loss_fn)
    assert engine.stats.recomputed_calls >= 1
    assert engine.stats.kept_attention_layers >= keep
    for n, p in model.named_parameters():
        err = (p.grad - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)
        assert err < 1e-5, (n, float(err))


# ------------------------------------------------- memory budget on long trees (issue 24)
MEMORY_MARGIN = 0.10  # measured activation peak <= budget x (1 + margin) + 1 GiB (allocator rounding, cuBLAS workspaces)


@pytest.mark.parametrize("fraction", [None, 0.5], ids=["whole-device", "half-device-limit"])
def test_long_trees_stay_within_the_default_budget(fraction):
    """Qwen3-1.7B shape, bf16, defaults: trees shaped like the 32k-token prefix (half of the
    tokens a prompt, 8 responses) from 4k to 64k tokens (scaled by the device's memory):
    each runs, its measured activation peak (above weights and gradients) within the budget
    plus the margin, the memory model's figure beside it; a tree whose path needs more than
    the budget is refused with one error. ``half-device-limit``: under
    ``torch.cuda.set_per_process_memory_fraction(0.5)`` the default budget halves with it."""
    from treerl.devtools.benchmark import weighted_logprob_loss
    from treerl.engine.plan import TreeTooLargeError
    from treerl.devtools.workloads import memory_sweep_tree

    torch.cuda.empty_cache()
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        model = build_model("qwen3", "qwen3-1.7b", dtype=torch.bfloat16, device="cuda", seed=0)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        engine = treerl.TreeEngine(model)
        engine.memory.model  # the probe's own allocations are not the step's
        budget = engine.memory.budget
        scale = torch.cuda.get_device_properties(0).total_memory * (fraction or 1.0) / 80e9
        rows, refused = [], []
        for tokens in (4096, 16384, 32768, 49152, 65536):
            tokens = max(1024, int(tokens * min(1.0, scale)) // 128 * 128)
            seqs = memory_sweep_tree(tokens, model.config.vocab_size)
            tree = treerl.PrefixTree.from_sequences(seqs)
            if engine.memory.call_budget.path_needs(max(map(len, seqs)))[0] > budget:
                with pytest.raises(TreeTooLargeError, match="root-to-leaf path"):
                    engine.plan(tree)
                refused.append(tokens)
                continue
            predicted = engine.plan(tree).peak_bytes
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            engine.forward_backward(tree, weighted_logprob_loss(tree), separable=True)
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated() - base
            rows.append((tokens, predicted / 2**30, measured / 2**30))
            assert measured <= budget * (1 + MEMORY_MARGIN) + 2**30, (rows, budget / 2**30)
        print(f"budget {budget / 2**30:.2f} GiB; (tokens, predicted GiB, measured GiB): {rows}; refused {refused}")
        assert len(rows) >= 3
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@pytest.mark.parametrize("mode,kw", [("dfs", {"chunk_tokens": 7}), ("auto", {"max_tokens": 40, "chunk_tokens": 16})])
def test_prefix_calls_as_whole_tiles_float32(mode, kw, monkeypatch):
    """``PREFIX_AS_TILES``: calls after a prefix run the whole-tile flex kernel with their
    queries padded in front to the keys' length; exact against the per-sequence forward."""
    import treerl.engine.attention as attention

    monkeypatch.setattr(attention, "PREFIX_AS_TILES", True)
    model = build_model("qwen3", "tiny", dtype=torch.float32, device="cuda", seed=1)
    seqs = [torch.as_tensor(s) for s in make_workload("long_prefix", SCALES["small"], 512, seed=3)]
    weights = [torch.randn(len(s) - 1, device="cuda", dtype=torch.float64) for s in seqs]

    def loss_fn(lps):
        return sum((lp.double() * w).sum() for lp, w in zip(lps, weights))

    model.zero_grad()
    loss_fn(reference_logprobs(model, seqs)).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine = treerl.TreeEngine(model, mode, attention="flex", **kw)
    assert any(s.parent >= 0 for s in engine.plan(seqs).segments)  # calls after a prefix
    model.zero_grad()
    engine.forward_backward(seqs, loss_fn)
    for n, p in model.named_parameters():
        err = (p.grad - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)
        assert err < 1e-5, (n, float(err))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy", [False, True])
def test_compiled_fused_token_loss_head(dtype, entropy):
    """The fused head's compiled chunks (one logits product a chunk, the gradients taken in the
    forward) against the recomputing head on the same inputs, and both against float64."""
    from treerl.engine.loss_head import token_logprobs, token_loss_head

    torch.manual_seed(0)
    T, H, V = 700, 256, 5000
    hidden = torch.randn(T, H, device="cuda", dtype=dtype) / 4
    weight = torch.randn(V, H, device="cuda", dtype=dtype) / 4
    targets = torch.randint(0, V, (T,), device="cuda")
    a = torch.randn(T, device="cuda", dtype=torch.float64)

    def term(lp, ent, rows):
        t = a[rows].to(lp.dtype) * lp + torch.exp(lp)
        return t + 0.3 * ent * ent if ent is not None else t

    token_grad = rows_token_grad(term)

    def grads(fused: bool, h, w, compiled=True):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        kw = dict(with_entropy=entropy, chunk_elements=128 * V, compiled=compiled)
        if fused:
            loss, lp, ent = token_loss_head(h, w, targets, token_grad, **kw)
        else:
            lp, ent = token_logprobs(h, w, targets, **kw)
            loss = term(lp, ent if entropy else None, slice(None)).sum()
        loss.backward()
        return loss.detach().double(), h.grad.double(), w.grad.double()

    ref = grads(False, hidden.double(), weight.double(), compiled=False)
    fused, recomputed = grads(True, hidden, weight), grads(False, hidden, weight)
    eager = grads(False, hidden, weight, compiled=False)  # (the compiled chunks: head_kernel's forward and gradient)
    for f, r, x, e in zip(fused, recomputed, eager, ref):
        scale = e.abs().max()
        assert (f - e).abs().max() <= 1.5 * (r - e).abs().max() + 1e-6 * scale  # no worse than the recomputing head
        assert (r - e).abs().max() <= 1.5 * (x - e).abs().max() + 1e-6 * scale  # compiled no worse than eager
