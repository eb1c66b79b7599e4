"""The log-linear proximal approximation (AReaL): the interpolation weights, exactness for
fresh tokens against the recomputed (tree-forward) proximal logprobs, a whole training
step equal to the recompute path when samples are fresh, and the behaviour weights it
reports on stale samples."""

import copy

import pytest
import torch

from helpers.configs import run_config
from treerl import PrefixTree
from treerl.rl import LogLinearPolicyLoss, loglinear_alpha, loglinear_proximal_logprobs
from treerl.models import rmsnorm_in_input_precision
from treerl.rl import PolicyLossConfig, TokenBatch
from treerl.tasks import get_task
from treerl.trainer import Trainer


def trainer(*extra) -> Trainer:
    cfg = run_config(None, "model.dtype=float64", "rollout.prompts_per_step=3", "rollout.group_size=4", "optim.lr=1e-2",
                     "algorithm.behaviour_weight_cap=5.0", *extra, layers=2)
    task = get_task("addition", digits=2)
    task.reward = lambda prompt, completion, **f: sum(ch in "13579" for ch in completion) / max(1, len(completion))
    t = Trainer(cfg, task=task)
    rmsnorm_in_input_precision(t.model)
    return t


def test_alpha_is_the_version_interpolation_weight():
    a = loglinear_alpha(torch.tensor([7, 6, 5, 3]), 7)
    torch.testing.assert_close(a, torch.tensor([0.0, 1 / 2, 2 / 3, 4 / 5], dtype=torch.float64))
    with pytest.raises(ValueError, match="newer"):
        loglinear_alpha(torch.tensor([8]), 7)
    behaviour, current = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    got = loglinear_proximal_logprobs(behaviour, current, torch.tensor([7, 6]), 7)
    torch.testing.assert_close(got, torch.tensor([-1.0, -1.5]))


def test_exact_for_fresh_tokens_against_recompute():
    """Versions equal to the trainer's: the approximation is the behaviour logprob, which
    is what a tree forward of the current weights recomputes (float64, 1e-9)."""
    t = trainer()
    samples = t.sampler.generate(t.sampler.next_problems(3), 4)
    V = t.sampler.rollout.version
    recomputed = t.engine.logprobs(PrefixTree.from_sequences([torch.tensor(s.token_ids) for s in samples]))
    for s, rec in zip(samples, recomputed):
        mask = torch.tensor(s.loss_mask)
        behav = torch.tensor(s.behaviour_logprobs, dtype=torch.float64)
        approx = loglinear_proximal_logprobs(behav, rec, torch.tensor(s.versions), V)
        err = (approx - rec)[mask].abs().max()
        assert err < 1e-9, float(err)


def test_fresh_training_step_equals_the_recompute_step():
    a, b = trainer(), trainer()
    b.model.load_state_dict(a.model.state_dict())
    samples = a.sampler.generate(a.sampler.next_problems(3), 4)
    before = torch.cat([p.detach().flatten() for p in a.model.parameters()]).clone()
    m_rec = a.train_on(copy.deepcopy(samples))
    m_log = b.train_on(copy.deepcopy(samples), proximal="loglinear")
    pa = torch.cat([p.detach().flatten() for p in a.model.parameters()])
    pb = torch.cat([p.detach().flatten() for p in b.model.parameters()])
    assert (pa - before).norm() > 0
    assert (pa - pb).norm() <= 1e-9 * (pa - before).norm()
    assert abs(m_rec["loss/loss"] - m_log["loss/loss"]) < 1e-9


def test_stale_tokens_get_interpolated_behaviour_weights():
    """Tokens 2 versions old: alpha = 2/3, behaviour weight exp(alpha (current - behav))
    (capped), reported per call."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 3]
    T = sum(lengths)
    behav = -torch.rand(T, generator=gen, dtype=torch.float64) * 2
    current = [(-torch.rand(n, generator=gen, dtype=torch.float64) * 2).requires_grad_() for n in lengths]
    mask = torch.tensor([False, True, True, True, True, True, True, True])
    versions = torch.full((T,), 5)
    alpha = loglinear_alpha(versions, 7)
    batch = TokenBatch.from_sequences([mask[:5], mask[5:]], torch.tensor([1.0, -0.5], dtype=torch.float64),
                                      behaviour_logprobs=list(behav.split(lengths)))
    loss = LogLinearPolicyLoss(batch, PolicyLossConfig(behaviour_weight_cap=1.5), alpha=alpha)
    value = loss(current)
    value.backward()
    cur = torch.cat([c.detach() for c in current])
    w = torch.exp(alpha * (cur - behav))[mask]
    m = loss.metrics()
    assert m["behaviour_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-12)
    assert m["behaviour_weight_max"] == pytest.approx(float(w.max()), rel=1e-12)
    assert m["behaviour_weight_capped_fraction"] == pytest.approx(float((w > 1.5).double().mean()), rel=1e-12)
    assert all(c.grad is not None for c in current)


def test_train_on_refuses_unknown_or_unusable_proximal_methods():
    from treerl.config import ConfigError

    t = trainer()
    samples = t.sampler.generate(t.sampler.next_problems(2), 2)
    with pytest.raises(ConfigError, match="unknown 'forward'"):
        t.train_on(samples, proximal="forward")
    t.cfg.algorithm.advantage = "reinforce_pp"
    with pytest.raises(ConfigError, match="reinforce_pp"):
        t.train_on(samples, proximal="loglinear")
