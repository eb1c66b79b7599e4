"""Policy and value losses against naive per-sequence, per-token computations: values,
gradients, metrics, partition invariance (separability) and bad inputs."""

import math
import re
import zlib

import pytest
import torch

from treerl.rl import Normalisers, PolicyLoss, PolicyLossConfig, TokenBatch, ValueLoss, ValueLossConfig

D = torch.float64
LENS = (5, 1, 0, 7, 3, 4, 6, 2, 1, 8)
ALL_MASKED = 5  # index of a sequence whose tokens are all untrained

# name -> (config kwargs, batch fields present, entropies passed)
VARIANTS = {
    "ppo": (dict(), {"behaviour"}, False),
    "dapo-dual-clip": (dict(eps_low=0.2, eps_high=0.28, dual_clip=1.2), {"behaviour"}, False),
    "decoupled": (dict(eps_high=0.28), {"behaviour", "proximal"}, False),
    "decoupled-cap": (dict(behaviour_weight_cap=1.15, dual_clip=1.2), {"behaviour", "proximal"}, False),
    "gspo": (dict(ratio="sequence", eps_low=0.03, eps_high=0.04), {"behaviour"}, False),
    "gspo-decoupled-dual": (
        dict(ratio="sequence", eps_low=0.05, eps_high=0.08, dual_clip=1.05, behaviour_weight_cap=1.2),
        {"behaviour", "proximal"},
        False,
    ),
    "kl-k1-entropy": (dict(kl_coef=0.3, kl_estimator="k1", entropy_coef=0.05), {"behaviour", "reference"}, True),
    "kl-k2": (dict(kl_coef=0.2, kl_estimator="k2"), {"behaviour", "reference"}, False),
    "kl-k3-entropy-decoupled": (
        dict(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, behaviour_weight_cap=1.3),
        {"behaviour", "proximal", "reference"},
        True,
    ),
    "on-policy-entropy": (dict(entropy_coef=0.02), set(), True),
}
AGGREGATIONS = [
    ("token-mean", None),
    ("seq-mean-token-sum", None),
    ("seq-mean-token-sum", 16.0),  # Dr.GRPO constant
    ("seq-mean-token-mean", None),
]
AGG_IDS = ["token-mean", "seq-mean-token-sum", "dr-grpo-constant", "seq-mean-token-mean"]


def make_case(seed, fields, lens=LENS, scale=0.4):
    """Random per-sequence data (float64) and current logprobs/entropies as grad leaves."""
    g = torch.Generator().manual_seed(seed)
    masks = [torch.rand(n, generator=g) < 0.75 for n in lens]
    masks[ALL_MASKED][:] = False
    if lens[1] == 1:
        masks[1][:] = True  # a single-token trained sequence
    adv = [torch.randn(n, generator=g, dtype=D) for n in lens]
    behav = [torch.randn(n, generator=g, dtype=D) * 0.5 - 1.5 for n in lens]
    prox = [b + torch.randn(len(b), generator=g, dtype=D) * 0.2 for b in behav]
    ref = [b + torch.randn(len(b), generator=g, dtype=D) * 0.3 for b in behav]
    old = prox if "proximal" in fields else behav
    logp = [(o + torch.randn(len(o), generator=g, dtype=D) * scale).requires_grad_() for o in old]
    ent = [(torch.rand(n, generator=g, dtype=D) * 2).requires_grad_() for n in lens]
    present = {"behaviour_logprobs": behav if "behaviour" in fields else None,
               "proximal_logprobs": prox if "proximal" in fields else None,
               "reference_logprobs": ref if "reference" in fields else None}
    batch = TokenBatch.from_sequences(masks, adv, **present)
    data = dict(masks=masks, adv=adv, behav=present["behaviour_logprobs"], prox=present["proximal_logprobs"],
                ref=present["reference_logprobs"])
    return batch, data, logp, ent


def naive_policy_loss(cfg: PolicyLossConfig, data, logp, ent):
    """Deliberately direct: loop over sequences and tokens, scalar autograd ops.

    Returns the loss and counts of the branches taken (to show the data exercise them)."""
    masks, adv, behav, prox, ref = data["masks"], data["adv"], data["behav"], data["prox"], data["ref"]
    counted = [i for i, m in enumerate(masks) if m.any()]
    num_tokens = sum(int(m.sum()) for m in masks)
    events = dict(clip=0, dual=0, capped=0, tokens=0)
    total = torch.zeros((), dtype=D)
    for i, m in enumerate(masks):
        idx = [t for t in range(len(m)) if m[t]]
        if not idx:
            continue
        if prox is not None:
            old = [float(x) for x in prox[i]]
        elif behav is not None:
            old = [float(x) for x in behav[i]]
        else:
            old = [float(x) for x in logp[i].detach()]
        if cfg.ratio == "sequence":
            seq_ratio = torch.exp(sum(logp[i][t] - old[t] for t in idx) / len(idx))
        seq_sum = torch.zeros((), dtype=D)
        for t in idx:
            events["tokens"] += 1
            A = float(adv[i][t])
            r = seq_ratio if cfg.ratio == "sequence" else torch.exp(logp[i][t] - old[t])
            r_clip = torch.clamp(r, 1 - cfg.eps_low, 1 + cfg.eps_high)
            pg = torch.max(-A * r, -A * r_clip)
            if float((-A * r_clip).detach()) > float((-A * r).detach()):
                events["clip"] += 1
            if cfg.dual_clip is not None and A < 0:
                if float(pg.detach()) > -A * cfg.dual_clip:
                    events["dual"] += 1
                pg = torch.min(pg, torch.tensor(-A * cfg.dual_clip, dtype=D))
            if prox is not None:
                w = math.exp(float(prox[i][t]) - float(behav[i][t]))
                if cfg.behaviour_weight_cap is not None and w > cfg.behaviour_weight_cap:
                    w = 0.0
                    events["capped"] += 1
                pg = w * pg
            term = pg
            if cfg.kl_coef:
                d = float(ref[i][t]) - logp[i][t]
                k = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - d - 1}[cfg.kl_estimator]
                term = term + cfg.kl_coef * k
            if cfg.entropy_coef:
                term = term - cfg.entropy_coef * ent[i][t]
            seq_sum = seq_sum + term
        if cfg.aggregation == "token-mean":
            total = total + seq_sum / num_tokens
        elif cfg.aggregation == "seq-mean-token-sum":
            total = total + seq_sum / (len(counted) * (cfg.norm_constant or 1.0))
        else:
            total = total + seq_sum / len(idx) / len(counted)
    return total, events


def _config(variant, agg):
    kwargs, fields, with_ent = VARIANTS[variant]
    return PolicyLossConfig(aggregation=agg[0], norm_constant=agg[1], **kwargs), fields, with_ent


def _seed(variant, agg):
    return zlib.crc32(f"{variant}/{agg}".encode()) % 1000


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves, allow_unused=True, retain_graph=True)


@pytest.mark.parametrize("agg", AGGREGATIONS, ids=AGG_IDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_policy_loss_and_gradients_match_naive(variant, agg):
    cfg, fields, with_ent = _config(variant, agg)
    batch, data, logp, ent = make_case(_seed(variant, agg), fields)
    loss_fn = PolicyLoss(batch, cfg)
    got = loss_fn(logp, ent if with_ent else None)
    want, events = naive_policy_loss(cfg, data, logp, ent)
    assert got.item() == pytest.approx(want.item(), rel=1e-11, abs=1e-14)
    leaves = logp + (ent if with_ent else [])
    for g_got, g_want in zip(_grads(got, leaves), _grads(want, leaves)):
        g_want = torch.zeros_like(g_got) if g_want is None else g_want
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-14)
    # The random data must exercise the branches the variant configures.
    if fields:  # on-policy (no behaviour logprobs) has ratio 1: nothing to clip
        assert 0 < events["clip"] < events["tokens"]
    if cfg.dual_clip is not None:
        assert events["dual"] > 0
    if cfg.behaviour_weight_cap is not None:
        assert 0 < events["capped"] < events["tokens"]


def _random_partition(S, g):
    perm = torch.randperm(S, generator=g)
    cuts = sorted(torch.randperm(S - 1, generator=g)[: int(torch.randint(1, S - 1, (1,), generator=g))] + 1)
    bounds = [0, *[int(c) for c in cuts], S]
    return [perm[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("agg", AGGREGATIONS, ids=AGG_IDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_policy_loss_is_separable(variant, agg):
    cfg, fields, with_ent = _config(variant, agg)
    batch, _, logp, ent = make_case(7 + _seed(variant, agg), fields)
    leaves = logp + (ent if with_ent else [])
    full_fn = PolicyLoss(batch, cfg)
    full = full_fn(logp, ent if with_ent else None)
    full_grads = _grads(full, leaves)
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        part_fn = PolicyLoss(batch, cfg)
        parts = _random_partition(batch.num_sequences, g)
        assert len(parts) > 1
        total = sum(
            part_fn([logp[i] for i in p], [ent[i] for i in p] if with_ent else None, index=p) for p in parts
        )
        assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-15)
        for a, b in zip(_grads(total, leaves), full_grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
        got, want = part_fn.metrics(), full_fn.metrics()
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-15), k


# decoupled variants for PolicyLoss(current_proximal=True): config kwargs
CURRENT_PROXIMAL = {
    "decoupled": dict(eps_high=0.28),
    "decoupled-cap-dual": dict(behaviour_weight_cap=1.15, dual_clip=1.2),
    "decoupled-cap-truncate": dict(behaviour_weight_cap=1.15, behaviour_weight_truncate=True),
    "gspo-decoupled-dual": dict(ratio="sequence", eps_low=0.05, eps_high=0.08, dual_clip=1.05,
                                behaviour_weight_cap=1.2),
    "kl-k3-entropy-decoupled": dict(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, behaviour_weight_cap=1.3),
}


@pytest.mark.parametrize("agg", AGGREGATIONS, ids=AGG_IDS)
@pytest.mark.parametrize("variant", list(CURRENT_PROXIMAL))
def test_current_proximal_equals_proximal_logprobs_equal_to_the_current_ones(variant, agg):
    """``current_proximal=True`` (no proximal field, called in parts) gives the loss, the
    gradients and every metric of a batch whose proximal logprobs are the current ones, and
    keeps the values it used."""
    cfg = PolicyLossConfig(aggregation=agg[0], norm_constant=agg[1], **CURRENT_PROXIMAL[variant])
    with_ent = cfg.entropy_coef != 0
    batch, _, logp, ent = make_case(13 + _seed(variant, agg), {"behaviour", "reference"} if cfg.kl_coef else {"behaviour"})
    leaves = logp + (ent if with_ent else [])
    current = torch.cat([lp.detach() for lp in logp])
    want_fn = PolicyLoss(batch.replace(proximal_logprobs=current.clone()), cfg)
    want = want_fn(logp, ent if with_ent else None)
    got_fn = PolicyLoss(batch, cfg, current_proximal=True)
    parts = _random_partition(batch.num_sequences, torch.Generator().manual_seed(_seed(variant, agg)))
    got = sum(got_fn([logp[i] for i in p], [ent[i] for i in p] if with_ent else None, index=p) for p in parts)
    assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    for a, b in zip(_grads(got, leaves), _grads(want, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    got_m, want_m = got_fn.metrics(), want_fn.metrics()
    assert got_m.keys() == want_m.keys() and "behaviour_weight_mean" in want_m
    for k in want_m:
        assert got_m[k] == pytest.approx(want_m[k], rel=1e-12, abs=1e-15), k
    if cfg.behaviour_weight_cap is not None:  # the data reach the cap, on some tokens only
        assert 0 < want_m["behaviour_weight_capped_fraction"] < 1
    assert torch.equal(got_fn.current_logprobs, current)


def test_current_proximal_input_errors():
    batch, _, _, _ = make_case(4, {"behaviour", "proximal"})
    with pytest.raises(ValueError, match="must not carry proximal_logprobs"):
        PolicyLoss(batch, current_proximal=True)
    with pytest.raises(ValueError, match="needs behaviour_logprobs"):
        PolicyLoss(batch.replace(proximal_logprobs=None, behaviour_logprobs=None), current_proximal=True)


def test_normalisers_make_rank_shares_sum_to_the_global_loss():
    cfg = PolicyLossConfig(aggregation="seq-mean-token-mean", kl_coef=0.1)
    batch, data, logp, _ = make_case(3, {"behaviour", "reference"})
    full = PolicyLoss(batch, cfg)(logp)
    halves = [list(range(0, 4)), list(range(4, len(LENS)))]
    norm = Normalisers.of(batch)
    total = 0.0
    for h in halves:
        share = TokenBatch.from_sequences(
            [data["masks"][i] for i in h], [data["adv"][i] for i in h],
            behaviour_logprobs=[data["behav"][i] for i in h], reference_logprobs=[data["ref"][i] for i in h],
        )
        total = total + PolicyLoss(share, cfg, normalisers=norm)([logp[i] for i in h])
    assert total.item() == pytest.approx(full.item(), rel=1e-12)


def test_metrics_match_naive():
    cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.28, dual_clip=1.5, behaviour_weight_cap=1.15, kl_coef=0.1,
                           kl_estimator="k2", entropy_coef=0.01)
    batch, data, logp, ent = make_case(5, {"behaviour", "proximal", "reference"}, scale=0.5)
    fn = PolicyLoss(batch, cfg)
    loss = fn(logp, ent)
    m = fn.metrics()
    low = high = dual = capped = n = 0
    ratios, kls, ref_kls, ents, weights = [], [], [], [], []
    for i, mask in enumerate(data["masks"]):
        for t in range(len(mask)):
            if not mask[t]:
                continue
            n += 1
            A, old, lp = float(data["adv"][i][t]), float(data["prox"][i][t]), float(logp[i][t].detach())
            r = math.exp(lp - old)
            ratios.append(r)
            low += A < 0 and r < 0.8
            high += A > 0 and r > 1.28
            dual += A < 0 and -A * max(r, 0.8) > -A * 1.5
            kls.append(math.exp(old - lp) - (old - lp) - 1)
            ref_kls.append(0.5 * (float(data["ref"][i][t]) - lp) ** 2)
            ents.append(float(ent[i][t].detach()))
            w = math.exp(old - float(data["behav"][i][t]))
            weights.append(w)
            capped += w > 1.15
    assert low and high and dual and capped
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-12)
    assert m["clip_fraction_low"] == pytest.approx(low / n)
    assert m["clip_fraction_high"] == pytest.approx(high / n)
    assert m["clip_fraction"] == pytest.approx((low + high) / n)
    assert m["dual_clip_fraction"] == pytest.approx(dual / n)
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / n, rel=1e-12)
    assert m["ratio_min"] == pytest.approx(min(ratios)) and m["ratio_max"] == pytest.approx(max(ratios))
    assert m["approx_kl"] == pytest.approx(sum(kls) / n, rel=1e-10)
    assert m["ref_kl"] == pytest.approx(sum(ref_kls) / n, rel=1e-10)
    assert m["kl_term"] == pytest.approx(sum(ref_kls) / n, rel=1e-10)  # token-mean of the KL
    assert m["entropy"] == pytest.approx(sum(ents) / n, rel=1e-12)
    assert m["behaviour_weight_mean"] == pytest.approx(sum(weights) / n, rel=1e-12)
    assert m["behaviour_weight_max"] == pytest.approx(max(weights), rel=1e-12)
    assert m["behaviour_weight_capped_fraction"] == pytest.approx(capped / n, rel=1e-12)
    fn.reset_metrics()
    assert fn.metrics() == {}


def test_gspo_equals_sequence_level_objective_for_sequence_advantages():
    """With one advantage per sequence, GSPO with seq-mean-token-mean is
    mean_i max(-A_i s_i, -A_i clip(s_i)) with s_i the geometric-mean ratio."""
    lens = (4, 6, 3, 5)
    g = torch.Generator().manual_seed(9)
    masks = [torch.ones(n, dtype=torch.bool) for n in lens]
    masks[1][:2] = False
    seq_adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=D)
    old = [torch.randn(n, generator=g, dtype=D) - 1 for n in lens]
    logp = [(o + 0.2 * torch.randn(len(o), generator=g, dtype=D)).requires_grad_() for o in old]
    batch = TokenBatch.from_sequences(masks, seq_adv, behaviour_logprobs=old)
    cfg = PolicyLossConfig(ratio="sequence", eps_low=0.05, eps_high=0.05, aggregation="seq-mean-token-mean")
    got = PolicyLoss(batch, cfg)(logp)
    want = 0.0
    for i in range(len(lens)):
        m = masks[i]
        s = math.exp(float((logp[i][m] - old[i][m]).mean().detach()))
        A = float(seq_adv[i])
        want += max(-A * s, -A * min(max(s, 0.95), 1.05)) / len(lens)
    assert got.item() == pytest.approx(want, rel=1e-12)


def test_fully_masked_batch_gives_zero_loss_with_zero_finite_gradient():
    lens = (3, 1, 2)
    masks = [torch.zeros(n, dtype=torch.bool) for n in lens]
    batch = TokenBatch.from_sequences(masks, torch.ones(3, dtype=D), behaviour_logprobs=[torch.zeros(n, dtype=D) for n in lens])
    logp = [torch.full((n,), -3.0, dtype=D, requires_grad=True) for n in lens]
    for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        loss = PolicyLoss(batch, PolicyLossConfig(ratio="sequence", aggregation=agg))(logp)
        assert loss.requires_grad and loss.item() == 0.0
        for gr in _grads(loss, logp):
            assert torch.equal(gr, torch.zeros_like(gr))


def test_untrained_tokens_with_extreme_logprobs_give_no_nan():
    # Prompt positions often carry placeholder behaviour logprobs: they must not leak.
    lens = (4, 3)
    masks = [torch.tensor([False, False, True, True]), torch.tensor([False, True, True])]
    behav = [torch.tensor([-1e4, 0.0, -1.0, -2.0], dtype=D), torch.tensor([-1e4, -1.0, -1.5], dtype=D)]
    ref = [torch.tensor([1e4, 0.0, -1.0, -2.0], dtype=D), torch.tensor([1e4, -1.0, -1.5], dtype=D)]
    batch = TokenBatch.from_sequences(masks, torch.tensor([1.0, -1.0], dtype=D), behaviour_logprobs=behav,
                                      proximal_logprobs=ref, reference_logprobs=ref)
    logp = [torch.tensor([-1e3, -50.0, -1.1, -2.1], dtype=D, requires_grad=True),
            torch.tensor([-1e3, -1.1, -1.4], dtype=D, requires_grad=True)]
    ent = [torch.tensor([math.nan, 1.0, 1.0, 1.0], dtype=D, requires_grad=True),
           torch.tensor([math.inf, 1.0, 1.0], dtype=D, requires_grad=True)]
    for ratio in ("token", "sequence"):
        cfg = PolicyLossConfig(ratio=ratio, kl_coef=0.5, entropy_coef=0.1)
        fn = PolicyLoss(batch, cfg)
        loss = fn(logp, ent)
        assert math.isfinite(loss.item())
        for gr in _grads(loss, logp + ent):
            assert torch.isfinite(gr).all()
        assert all(math.isfinite(v) for v in fn.metrics().values())


def test_behaviour_weight_cap_masks_tokens_but_keeps_the_normaliser():
    masks = [torch.ones(2, dtype=torch.bool)]
    behav = [torch.tensor([-1.0, -1.0], dtype=D)]
    prox = [torch.tensor([-1.0, 0.0], dtype=D)]  # weights 1 and e
    logp = [prox[0].clone().requires_grad_()]
    batch = TokenBatch.from_sequences(masks, torch.tensor([2.0], dtype=D), behaviour_logprobs=behav, proximal_logprobs=prox)
    capped = PolicyLoss(batch, PolicyLossConfig(behaviour_weight_cap=2.0))(logp)
    uncapped = PolicyLoss(batch, PolicyLossConfig())(logp)
    assert capped.item() == pytest.approx(-2.0 / 2)  # only the first token, divided by 2 tokens
    assert uncapped.item() == pytest.approx(-2.0 * (1 + math.e) / 2)


def test_on_policy_gradient_is_reinforce():
    batch, data, logp, _ = make_case(2, set())
    loss = PolicyLoss(batch, PolicyLossConfig())(logp)
    n = sum(int(m.sum()) for m in data["masks"])
    assert loss.item() == pytest.approx(-float(batch.advantages[batch.loss_mask].sum()) / n, rel=1e-12)
    for gr, m, a in zip(_grads(loss, logp), data["masks"], data["adv"]):
        torch.testing.assert_close(gr, torch.where(m, -a / n, 0.0), rtol=1e-12, atol=0)


def test_policy_loss_input_errors():
    batch, data, logp, ent = make_case(1, {"behaviour"})
    fn = PolicyLoss(batch, PolicyLossConfig())
    with pytest.raises(ValueError, match="got 2 logprobs tensors for 3 sequences"):
        fn(logp[:2], index=[0, 1, 3])
    with pytest.raises(ValueError, match=re.escape("logprobs of sequence 3 has shape (6,) but the batch has 7 predicted tokens")):
        fn([logp[0], logp[6]], index=[0, 3])
    with pytest.raises(IndexError, match="outside the batch"):
        fn([logp[0]], index=[len(LENS)])
    with pytest.raises(ValueError, match="call the loss with entropies"):
        PolicyLoss(batch, PolicyLossConfig(entropy_coef=0.1))(logp)
    with pytest.raises(ValueError, match="no reference_logprobs"):
        PolicyLoss(batch, PolicyLossConfig(kl_coef=0.1))
    for bad, msg in [(dict(ratio="seq"), "unknown ratio level"), (dict(eps_low=1.0), "eps_low"),
                     (dict(dual_clip=1.0), "dual_clip must be > 1"), (dict(behaviour_weight_cap=0.0), "positive"),
                     (dict(aggregation="mean"), "unknown aggregation"), (dict(norm_constant=8.0), "seq-mean-token-sum only"),
                     (dict(kl_estimator="k5"), "unknown KL estimator")]:
        with pytest.raises(ValueError, match=msg):
            PolicyLossConfig(**bad)


# ------------------------------------------------------------------ value loss
def naive_value_loss(cfg, masks, returns, old, values):
    counted = [i for i, m in enumerate(masks) if m.any()]
    num_tokens = sum(int(m.sum()) for m in masks)
    total, clipped_count = torch.zeros((), dtype=D), 0
    for i, m in enumerate(masks):
        idx = [t for t in range(len(m)) if m[t]]
        if not idx:
            continue
        s = torch.zeros((), dtype=D)
        for t in idx:
            R, v = float(returns[i][t]), values[i][t]
            loss = 0.5 * (v - R) ** 2
            if cfg.clip is not None:
                o = float(old[i][t])
                vc = o + torch.clamp(v - o, -cfg.clip, cfg.clip)
                lc = 0.5 * (vc - R) ** 2
                clipped_count += float(lc.detach()) > float(loss.detach())
                loss = torch.max(loss, lc)
            s = s + loss
        if cfg.aggregation == "token-mean":
            total = total + s / num_tokens
        elif cfg.aggregation == "seq-mean-token-sum":
            total = total + s / len(counted) / (cfg.norm_constant or 1.0)
        else:
            total = total + s / len(idx) / len(counted)
    return total, clipped_count


@pytest.mark.parametrize("agg", AGGREGATIONS, ids=AGG_IDS)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_naive_and_is_separable(agg, clip):
    g = torch.Generator().manual_seed(21)
    masks = [torch.rand(n, generator=g) < 0.75 for n in LENS]
    masks[ALL_MASKED][:] = False
    returns = [torch.randn(n, generator=g, dtype=D) for n in LENS]
    old = [torch.randn(n, generator=g, dtype=D) for n in LENS]
    values = [(o + 0.4 * torch.randn(len(o), generator=g, dtype=D)).requires_grad_() for o in old]
    batch = TokenBatch.from_sequences(masks, torch.zeros(len(LENS), dtype=D), values=old, returns=returns)
    cfg = ValueLossConfig(clip=clip, aggregation=agg[0], norm_constant=agg[1])
    fn = ValueLoss(batch, cfg)
    got = fn(values)
    want, clipped = naive_value_loss(cfg, masks, returns, old, values)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    for a, b in zip(_grads(got, values), _grads(want, values)):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-11, atol=1e-15)
    n = sum(int(m.sum()) for m in masks)
    if clip is not None:
        assert clipped > 0 and fn.metrics()["clip_fraction"] == pytest.approx(clipped / n)
    parts = _random_partition(len(LENS), g)
    total = sum(fn([values[i] for i in p], index=p) for p in parts)
    assert total.item() == pytest.approx(got.item(), rel=1e-12)
    for a, b in zip(_grads(total, values), _grads(got, values)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_value_loss_errors():
    masks = [torch.ones(2, dtype=torch.bool)]
    batch = TokenBatch.from_sequences(masks, torch.zeros(1, dtype=D))
    with pytest.raises(ValueError, match="needs batch.returns"):
        ValueLoss(batch)
    batch = batch.replace(returns=torch.zeros(2, dtype=D))
    with pytest.raises(ValueError, match="needs batch.values"):
        ValueLoss(batch, ValueLossConfig(clip=0.2))
    with pytest.raises(ValueError, match="values of sequence 0 has shape"):
        ValueLoss(batch)([torch.zeros(3, dtype=D, requires_grad=True)])
    with pytest.raises(ValueError, match="clip must be positive"):
        ValueLossConfig(clip=0.0)
