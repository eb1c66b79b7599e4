"""The independent per-sequence reference: the Hugging Face model itself, one sequence per
call, with its own attention implementation; log-softmax in float64. And the comparisons of
logprobs and gradients against it (tolerances and floors per dtype)."""

from __future__ import annotations

import torch


def zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where autograd left None)."""
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


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
    completion (:func:`reference_logprobs`), float64. Remembered for the session by
    :func:`forward_key` (the rollout tests' parametrizations ask for the same ones)."""
    key = forward_key(model)
    if key is not None:
        key = (key, tuple(int(t) for t in prompt), tuple(int(t) for t in completion), float(temperature))
        if key in _COMPLETIONS:
            return _COMPLETIONS[key].clone()
    with torch.no_grad():
        lps, _ = reference_logprobs(model, [list(prompt) + list(completion)], temperature=temperature)
    out = lps[0][len(prompt) - 1:]
    if key is not None:
        _COMPLETIONS[key] = out.clone()
    return out


_COMPLETIONS: dict = {}  # completion_logprobs's, by (forward_key, prompt, completion, temperature)


def forward_key(model: torch.nn.Module) -> str | None:
    """What a plain forward of ``model`` computes from: its class, config (with the attention
    implementation), every module's class and train/eval mode, and every parameter's and
    buffer's name, dtype, shape and bytes (a digest), and any instance-level ``forward`` (a
    module-level function bound to its module, as :func:`treerl.models.rmsnorm_in_input_precision`
    sets). None when a forward hook (global or on any module), another instance-level
    ``forward`` or a PEFT adapter (enabled and disabled by flags) could make a forward do
    something else."""
    import hashlib

    from torch.nn.modules import module as nn_module

    if any(getattr(nn_module, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                         "_global_forward_hooks_always_called")):
        return None
    config = getattr(model, "config", None)
    if config is None:
        return None
    digest = hashlib.sha1()
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return None
        if type(m).__module__.startswith("peft"):  # adapters switched on and off by flags, not weights
            return None
        forward = m.__dict__.get("forward")  # an instance-level forward: a module function bound to m only
        if forward is not None:
            func = getattr(forward, "__func__", None)
            if getattr(forward, "__self__", None) is not m or func is None or "<" in func.__qualname__:
                return None
            forward = f"{func.__module__}.{func.__qualname__}"  # (rmsnorm_in_input_precision's)
        digest.update(f"{name}:{type(m).__module__}.{type(m).__qualname__}:{m.training}:{forward};".encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:  # (buffers: non-persistent ones too)
        t = t.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    digest.update((config.to_json_string(use_diff=False) + str(config._attn_implementation)).encode())
    return digest.hexdigest()


def reference_step(model, seqs, loss_fn, *, entropy: bool = False, temperature: float = 1.0):
    """(loss, grads, logprobs, entropies) of training on every sequence independently."""
    zero_grads(model)
    lps, ents = reference_logprobs(model, seqs, temperature=temperature)
    loss = loss_fn(lps, ents) if entropy else loss_fn(lps)
    loss.backward()
    grads = grads_of(model)
    zero_grads(model)
    return float(loss.detach()), grads, [x.detach() for x in lps], [x.detach() for x in ents]


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
