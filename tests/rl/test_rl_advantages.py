"""Advantage estimators against naive per-sample / per-token Python computations."""

import math
import re
import statistics

import pytest
import torch

from treerl.rl import (
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

D = torch.float64


def _groups(seed, num_groups=5, sizes=(1, 2, 3, 4, 6)):
    g = torch.Generator().manual_seed(seed)
    ids = [k for k in range(num_groups) for _ in range(sizes[k % len(sizes)])]
    perm = torch.randperm(len(ids), generator=g).tolist()
    ids = [10 * ids[p] + 7 for p in perm]  # arbitrary, non-contiguous labels
    rewards = torch.randn(len(ids), generator=g, dtype=D)
    return rewards, ids


def _by_group(ids):
    groups = {}
    for i, k in enumerate(ids):
        groups.setdefault(k, []).append(i)
    return groups


# ---------------------------------------------------------------------- GRPO
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("normalise_std", [True, False])
@pytest.mark.parametrize("unbiased", [True, False])
def test_grpo_matches_naive(seed, normalise_std, unbiased):
    rewards, ids = _groups(seed)
    eps = 1e-6
    got = grpo_advantages(rewards, torch.tensor(ids), normalise_std=normalise_std, eps=eps, unbiased_std=unbiased)
    r = rewards.tolist()
    for members in _by_group(ids).values():
        vals = [r[i] for i in members]
        mean = sum(vals) / len(vals)
        if len(vals) == 1:
            std = 0.0
        else:
            std = statistics.stdev(vals) if unbiased else statistics.pstdev(vals)
        for i in members:
            want = (r[i] - mean) / (std + eps) if normalise_std else r[i] - mean
            assert got[i].item() == pytest.approx(want, rel=1e-10, abs=1e-12)


def test_grpo_group_ids_may_be_any_hashables():
    rewards, ids = _groups(1)
    labels = [f"prompt-{k}" for k in ids]
    assert torch.equal(grpo_advantages(rewards, labels), grpo_advantages(rewards, torch.tensor(ids)))


def test_dr_grpo_is_centred_reward():
    rewards, ids = _groups(2)
    got = dr_grpo_advantages(rewards, ids)
    r = rewards.tolist()
    for members in _by_group(ids).values():
        mean = sum(r[i] for i in members) / len(members)
        for i in members:
            assert got[i].item() == pytest.approx(r[i] - mean, abs=1e-12)


@pytest.mark.parametrize("fn", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_identical_rewards_give_exact_zero(fn):
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.1, 0.1, 1e-9, 1e-9], dtype=D)
    ids = [0, 0, 0, 1, 1, 2, 2]
    adv = fn(rewards, ids)
    assert torch.isfinite(adv).all()
    assert (adv == 0).all()


def test_group_of_one_gets_zero_grpo_advantage():
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 2.0], dtype=D), [0, 1, 1])
    assert adv[0].item() == 0.0 and torch.isfinite(adv).all()


# ---------------------------------------------------------------------- RLOO
@pytest.mark.parametrize("seed", range(3))
def test_rloo_matches_naive(seed):
    rewards, ids = _groups(seed, sizes=(2, 3, 5, 4))
    got = rloo_advantages(rewards, ids)
    r = rewards.tolist()
    for members in _by_group(ids).values():
        for i in members:
            others = [r[j] for j in members if j != i]
            assert got[i].item() == pytest.approx(r[i] - sum(others) / len(others), rel=1e-12, abs=1e-12)


def test_rloo_group_of_one_is_an_error():
    with pytest.raises(ValueError, match="sample 2 is alone in its group .group id 9"):
        rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4, 4, 9]))


@pytest.mark.parametrize("fn", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_reward_names_the_sample(fn, bad):
    rewards = torch.tensor([0.0, 1.0, bad, 1.0])
    with pytest.raises(ValueError, match=rf"reward of sample 2 is {bad}"):
        fn(rewards, [0, 0, 1, 1])


def test_group_ids_length_mismatch():
    with pytest.raises(ValueError, match="group_ids has 3 entries but rewards has 4"):
        grpo_advantages(torch.zeros(4), [0, 0, 1])


# ----------------------------------------------------------------------- GAE
def _token_data(lens, seed, p_mask=0.7):
    g = torch.Generator().manual_seed(seed)
    masks = [torch.rand(n, generator=g) < p_mask for n in lens]
    if len(lens) > 2:
        masks[2][:] = False  # a sequence with no trained token
    rewards = [torch.where(m, torch.randn(len(m), generator=g, dtype=D), 0.0) for m in masks]
    values = [torch.randn(n, generator=g, dtype=D) for n in lens]
    return masks, rewards, values


def _naive_gae(mask, rewards, values, gamma, lam):
    idx = [t for t in range(len(mask)) if mask[t]]
    adv = [0.0] * len(mask)
    ret = [0.0] * len(mask)
    running, next_value = 0.0, 0.0
    for t in reversed(idx):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t], ret[t] = running, running + values[t]
        next_value = values[t]
    return adv, ret


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_gae_matches_naive(seed, gamma, lam):
    lens = [5, 1, 4, 0, 9, 3]
    masks, rewards, values = _token_data(lens, seed)
    adv, ret = gae(torch.cat(rewards), torch.cat(values), torch.cat(masks), torch.tensor(lens), gamma=gamma, lam=lam)
    off = 0
    for m, r, v in zip(masks, rewards, values):
        want_adv, want_ret = _naive_gae(m.tolist(), r.tolist(), v.tolist(), gamma, lam)
        n = len(m)
        assert adv[off : off + n].tolist() == pytest.approx(want_adv, rel=1e-12, abs=1e-12)
        assert ret[off : off + n].tolist() == pytest.approx(want_ret, rel=1e-12, abs=1e-12)
        off += n


def test_gae_rejects_rewards_off_the_mask_and_non_finite_inputs():
    lens = torch.tensor([2, 3])
    mask = torch.tensor([True, True, True, False, True])
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.0], dtype=D)
    with pytest.raises(ValueError, match="sequence 1 has reward 0.5 on untrained token 1"):
        gae(rewards, torch.zeros(5, dtype=D), mask, lens)
    rewards[3] = 0.0
    rewards[2] = math.nan
    with pytest.raises(ValueError, match="rewards of sequence 1 is nan at token 0"):
        gae(rewards, torch.zeros(5, dtype=D), mask, lens)
    rewards[2] = 0.0
    with pytest.raises(ValueError, match="rewards of sequence 2 is inf at token 0"):  # after an empty sequence
        gae(torch.tensor([0.0, 0.0, math.inf]), torch.zeros(3), torch.ones(3, dtype=torch.bool), torch.tensor([2, 0, 1]))
    values = torch.zeros(5, dtype=D)
    values[1] = math.inf
    with pytest.raises(ValueError, match="values of sequence 0 is inf at token 1"):
        gae(rewards, values, mask, lens)
    with pytest.raises(ValueError, match=re.escape("values has shape (4,) but seq_lengths sum to 5")):
        gae(rewards, torch.zeros(4, dtype=D), mask, lens)


# ---------------------------------------------------------------- REINFORCE++
def _naive_reinforce_pp(rewards, masks, kl, kl_coef, gamma, groups=None, eps=1e-8):
    r = list(rewards)
    if groups is not None:
        members = _by_group(groups)
        for k, idx in members.items():
            mean = sum(rewards[i] for i in idx) / len(idx)
            for i in idx:
                r[i] = rewards[i] - mean
    per_seq = []
    for i, m in enumerate(masks):
        idx = [t for t in range(len(m)) if m[t]]
        tok_r = {t: -kl_coef * kl[i][t] for t in idx}
        if idx:
            tok_r[idx[-1]] += r[i]
        g, out = 0.0, {}
        for t in reversed(idx):
            g = tok_r[t] + gamma * g
            out[t] = g
        per_seq.append(out)
    all_g = [g for out in per_seq for g in out.values()]
    mean = sum(all_g) / len(all_g)
    std = math.sqrt(sum((x - mean) ** 2 for x in all_g) / len(all_g))
    return [[(out[t] - mean) / (std + eps) if t in out else 0.0 for t in range(len(m))] for out, m in zip(per_seq, masks)]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("kl_coef,gamma,grouped", [(0.0, 1.0, False), (0.1, 1.0, False), (0.05, 0.9, True)])
def test_reinforce_pp_matches_naive(seed, kl_coef, gamma, grouped):
    lens = [4, 6, 3, 1, 7, 5]
    masks, _, _ = _token_data(lens, seed)
    g = torch.Generator().manual_seed(100 + seed)
    rewards = torch.randn(len(lens), generator=g, dtype=D)
    kl = [torch.randn(n, generator=g, dtype=D).abs() for n in lens]
    groups = [0, 0, 1, 1, 2, 2] if grouped else None
    got = reinforce_pp_advantages(
        rewards, torch.tensor(lens), torch.cat(masks), kl=torch.cat(kl), kl_coef=kl_coef, gamma=gamma, group_ids=groups
    )
    want = _naive_reinforce_pp(rewards.tolist(), [m.tolist() for m in masks], [k.tolist() for k in kl], kl_coef, gamma, groups)
    assert got.tolist() == pytest.approx([x for w in want for x in w], rel=1e-10, abs=1e-12)


def test_reinforce_pp_errors():
    with pytest.raises(ValueError, match="reward of sample 1 is nan"):
        reinforce_pp_advantages(torch.tensor([0.0, math.nan]), torch.tensor([1, 1]), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="rewards has 2 samples but seq_lengths has 3"):
        reinforce_pp_advantages(torch.zeros(2), torch.tensor([1, 1, 1]), torch.ones(3, dtype=torch.bool))
    kl = torch.tensor([0.0, math.inf, 0.0])
    with pytest.raises(ValueError, match="kl of sequence 1 is inf at token 0"):
        reinforce_pp_advantages(torch.zeros(2), torch.tensor([1, 2]), torch.ones(3, dtype=torch.bool), kl=kl, kl_coef=0.1)
