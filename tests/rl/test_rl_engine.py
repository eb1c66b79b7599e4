"""The RL losses through TreeEngine.forward_backward: with ``separable=True`` the engine
calls them per micro-batch with ``index=``; gradients must equal those of the loss on an
independent per-sequence forward of the model."""

import pytest
import torch

from helpers.models import tiny_model
from treerl import TreeEngine
from treerl.rl import PolicyLoss, PolicyLossConfig, TokenBatch, ValueLoss, ValueLossConfig, grpo_advantages

D = torch.float64


def _rollouts(seed=0, vocab=512):
    """Two GRPO groups (shared prompts) plus an agentic chain of strict prefixes."""
    g = torch.Generator().manual_seed(seed)
    seqs, prompt_lens, groups = [], [], []
    for group in range(2):
        prompt = torch.randint(0, vocab, (6 + group,), generator=g)
        for _ in range(3):
            completion = torch.randint(0, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
            seqs.append(torch.cat([prompt, completion]))
            prompt_lens.append(len(prompt))
            groups.append(group)
    turn = torch.randint(0, vocab, (4,), generator=g)
    for k in range(3):
        turn = torch.cat([turn, torch.randint(0, vocab, (3,), generator=g)])
        seqs.append(turn.clone())
        prompt_lens.append(len(turn) - 2)
        groups.append(2)
    return seqs, prompt_lens, groups, g


def _reference_forward(model, seqs):
    lps, ents = [], []
    for s in seqs:
        logits = model(input_ids=s[None]).logits[0, :-1].to(D)
        logp_all = torch.log_softmax(logits, -1)
        lps.append(logp_all.gather(1, s[1:, None])[:, 0])
        ents.append(-(logp_all.exp() * logp_all).sum(-1))
    return lps, ents


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("ratio", ["sequence", "token"])  # token: the fused head (PolicyLoss.token_loss)
@pytest.mark.parametrize("mode,max_tokens", [("flat", 24), ("packed", 24), ("dfs", 16)])
def test_policy_loss_through_engine_matches_per_sequence_forward(mode, max_tokens, ratio):
    model = tiny_model(dtype=D, seed=1, precise_norm=True)
    seqs, prompt_lens, groups, g = _rollouts()
    masks = [torch.arange(1, len(s)) >= p for s, p in zip(seqs, prompt_lens)]
    with torch.no_grad():
        behav, _ = _reference_forward(model, seqs)
    behav = [b + 0.1 * torch.randn(len(b), generator=g, dtype=D) for b in behav]
    prox = [b + 0.05 * torch.randn(len(b), generator=g, dtype=D) for b in behav]
    ref = [b + 0.1 * torch.randn(len(b), generator=g, dtype=D) for b in behav]
    rewards = torch.randn(len(seqs), generator=g, dtype=D)
    batch = TokenBatch.from_sequences(
        masks, grpo_advantages(rewards, groups), behaviour_logprobs=behav, proximal_logprobs=prox, reference_logprobs=ref
    )
    cfg = PolicyLossConfig(ratio=ratio, eps_high=0.28, dual_clip=3.0, behaviour_weight_cap=1.1, kl_coef=0.1,
                           entropy_coef=0.01, aggregation="seq-mean-token-mean")

    model.zero_grad()
    lps, ents = _reference_forward(model, seqs)
    want_loss = PolicyLoss(batch, cfg)
    want = want_loss(lps, ents)
    want.backward()
    want_grads = _grads(model)

    engine = TreeEngine(model, mode, max_tokens=max_tokens, chunk_tokens=8, attention="sdpa")
    model.zero_grad()
    loss = PolicyLoss(batch, cfg)
    got = engine.forward_backward(seqs, loss, entropy=True, separable=loss.separable)
    if mode != "dfs":
        assert engine.stats.model_calls > 1  # the loss really was called in parts
    assert got == pytest.approx(want.item(), rel=1e-10)
    assert (loss.token_loss is None) == (ratio == "sequence")
    assert loss.metrics() == pytest.approx(want_loss.metrics(), rel=1e-9, abs=1e-12)  # the loss and its metrics
    for a, b in zip(_grads(model), want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_value_loss_through_engine_logprob_interface():
    # Any per-token head works through the same protocol; use the logprobs as "values".
    model = tiny_model(dtype=D, seed=2, precise_norm=True)
    seqs, prompt_lens, _, g = _rollouts(1)
    masks = [torch.arange(1, len(s)) >= p for s, p in zip(seqs, prompt_lens)]
    returns = [torch.randn(len(m), generator=g, dtype=D) - 6 for m in masks]
    with torch.no_grad():
        old, _ = _reference_forward(model, seqs)
    batch = TokenBatch.from_sequences(masks, torch.zeros(len(seqs), dtype=D), values=old, returns=returns)
    cfg = ValueLossConfig(clip=0.5, aggregation="seq-mean-token-sum")
    model.zero_grad()
    want = ValueLoss(batch, cfg)(_reference_forward(model, seqs)[0])
    want.backward()
    want_grads = _grads(model)
    model.zero_grad()
    engine = TreeEngine(model, "flat", max_tokens=20, attention="sdpa")
    got = engine.forward_backward(seqs, ValueLoss(batch, cfg), separable=True)
    assert engine.stats.model_calls > 1
    assert got == pytest.approx(want.item(), rel=1e-10)
    for a, b in zip(_grads(model), want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
