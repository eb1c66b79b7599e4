"""TokenBatch construction/validation, broadcasting, KL estimators, aggregation weights."""

import math
import re

import pytest
import torch

from treerl.rl import (
    KL_ESTIMATORS,
    Normalisers,
    TokenBatch,
    broadcast_to_tokens,
    kl_estimate,
    sequence_ids,
    token_weights,
)

D = torch.float64


def _seqs(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    masks = [torch.rand(n, generator=g) < 0.7 for n in lens]
    lp = [torch.randn(n, generator=g, dtype=D) - 2 for n in lens]
    return masks, lp


def test_from_sequences_concatenates_in_order():
    lens = [3, 0, 4, 1]
    masks, lp = _seqs(lens)
    adv = [torch.randn(n, dtype=D) for n in lens]
    b = TokenBatch.from_sequences(masks, adv, behaviour_logprobs=lp, versions=[torch.full((n,), i) for i, n in enumerate(lens)])
    assert b.seq_lengths.tolist() == lens and b.num_sequences == 4 and b.num_tokens == 8
    assert b.offsets.tolist() == [0, 3, 3, 7, 8]
    for i, n in enumerate(lens):
        s = slice(int(b.offsets[i]), int(b.offsets[i + 1]))
        assert torch.equal(b.loss_mask[s], masks[i])
        assert torch.equal(b.advantages[s], adv[i])
        assert torch.equal(b.behaviour_logprobs[s], lp[i])
        assert (b.versions[s] == i).all()
    assert b.seq_ids().tolist() == [0, 0, 0, 2, 2, 2, 2, 3]
    counts = [int(m.sum()) for m in masks]
    assert b.masked_counts().tolist() == counts


def test_per_sequence_advantages_broadcast_over_masked_tokens():
    lens = [2, 3, 1]
    masks = [torch.tensor([True, False]), torch.tensor([False, True, True]), torch.tensor([False])]
    b = TokenBatch.from_sequences(masks, torch.tensor([1.5, -2.0, 7.0], dtype=D))
    assert b.advantages.tolist() == [1.5, 0.0, 0.0, -2.0, -2.0, 0.0]
    assert broadcast_to_tokens(torch.tensor([1.0, 2.0, 3.0]), torch.tensor(lens)).tolist() == [1, 1, 2, 2, 2, 3]
    assert sequence_ids(torch.tensor(lens)).tolist() == [0, 0, 1, 1, 1, 2]


def test_length_mismatch_names_field_sequence_and_lengths():
    masks, lp = _seqs([3, 5, 2])
    lp[1] = lp[1][:4]
    with pytest.raises(ValueError, match=re.escape("behaviour_logprobs of sequence 1 has 4 tokens but its loss_mask has 5")):
        TokenBatch.from_sequences(masks, torch.zeros(3, dtype=D), behaviour_logprobs=lp)
    with pytest.raises(ValueError, match="reference_logprobs has 2 sequences but loss_mask has 3"):
        TokenBatch.from_sequences(masks, torch.zeros(3, dtype=D), reference_logprobs=lp[:2])
    adv = [torch.zeros(n, dtype=D) for n in (3, 5, 3)]
    with pytest.raises(ValueError, match=re.escape("advantages of sequence 2 has 3 tokens but its loss_mask has 2")):
        TokenBatch.from_sequences(masks, adv)
    with pytest.raises(ValueError, match=re.escape("per-sequence advantages must have shape (3,)")):
        TokenBatch.from_sequences(masks, torch.zeros(4, dtype=D))
    with pytest.raises(TypeError, match="unknown TokenBatch field"):
        TokenBatch.from_sequences(masks, torch.zeros(3, dtype=D), behavior_logprobs=lp)


def test_flat_construction_checks_totals_dtypes_and_devices():
    lens = torch.tensor([2, 3])
    with pytest.raises(ValueError, match=re.escape("values has shape (4,) but the sequences have 5 predicted tokens")):
        TokenBatch(lens, torch.ones(5, dtype=torch.bool), torch.zeros(5, dtype=D), values=torch.zeros(4, dtype=D))
    with pytest.raises(ValueError, match="loss_mask must be a bool tensor"):
        TokenBatch(lens, torch.ones(5), torch.zeros(5, dtype=D))
    with pytest.raises(ValueError, match="advantages must be a floating-point tensor"):
        TokenBatch(lens, torch.ones(5, dtype=torch.bool), torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match=re.escape("seq_lengths[1] is -1")):
        TokenBatch(torch.tensor([2, -1]), torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=D))
    with pytest.raises(ValueError, match="needs behaviour_logprobs"):
        TokenBatch(lens, torch.ones(5, dtype=torch.bool), torch.zeros(5, dtype=D), proximal_logprobs=torch.zeros(5, dtype=D))


@pytest.mark.parametrize("field", ["advantages", "behaviour_logprobs", "proximal_logprobs", "reference_logprobs", "values", "returns"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("token", [0, 2])  # first token: right after an empty sequence
def test_non_finite_values_name_the_sequence(field, bad, token):
    lens = [2, 0, 3, 4]
    masks, _ = _seqs(lens)
    fields = {f: [torch.zeros(n, dtype=D) for n in lens] for f in
              ("behaviour_logprobs", "proximal_logprobs", "reference_logprobs", "values", "returns")}
    fields["advantages"] = [torch.zeros(n, dtype=D) for n in lens]
    fields[field][2][token] = bad
    adv = fields.pop("advantages")
    with pytest.raises(ValueError, match=rf"{field} of sequence 2 is {bad} at token {token}"):
        TokenBatch.from_sequences(masks, adv, **fields)


def test_token_index_gathers_requested_sequences():
    masks, lp = _seqs([3, 0, 2, 4])
    b = TokenBatch.from_sequences(masks, torch.zeros(4, dtype=D), behaviour_logprobs=lp)
    flat, seqs = b.token_index(torch.tensor([3, 0, 1]))
    assert seqs == [3, 0, 1]
    assert torch.equal(b.behaviour_logprobs[flat], torch.cat([lp[3], lp[0], lp[1]]))
    assert b.token_index(None) == (None, [0, 1, 2, 3])
    assert b.token_index([0, 1, 2, 3])[0] is None
    with pytest.raises(IndexError, match="sequence index 4 is outside the batch of 4 sequences"):
        b.token_index([1, 4])


# ------------------------------------------------------------------------- KL
def test_kl_estimators_match_their_formulas():
    g = torch.Generator().manual_seed(3)
    lp, ref = torch.randn(50, generator=g, dtype=D), torch.randn(50, generator=g, dtype=D)
    for i in range(50):
        d = ref[i].item() - lp[i].item()
        assert kl_estimate(lp[i], ref[i], "k1").item() == pytest.approx(-d, rel=1e-12)
        assert kl_estimate(lp[i], ref[i], "k2").item() == pytest.approx(0.5 * d * d, rel=1e-12)
        assert kl_estimate(lp[i], ref[i], "k3").item() == pytest.approx(math.exp(d) - d - 1, rel=1e-10, abs=1e-14)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(lp, ref, "k4")


def test_k1_and_k3_are_unbiased_for_the_exact_kl():
    # E_{x~p}[k(x)] summed exactly over a vocabulary equals KL(p || q) for k1 and k3.
    g = torch.Generator().manual_seed(4)
    logp = torch.log_softmax(torch.randn(20, generator=g, dtype=D), 0)
    logq = torch.log_softmax(torch.randn(20, generator=g, dtype=D), 0)
    kl = sum(math.exp(a) * (a - b) for a, b in zip(logp.tolist(), logq.tolist()))
    p = logp.exp()
    for est in KL_ESTIMATORS:
        expect = (p * kl_estimate(logp, logq, est)).sum().item()
        if est == "k2":
            assert abs(expect - kl) > 1e-3  # biased
        else:
            assert expect == pytest.approx(kl, rel=1e-12)


# ----------------------------------------------------------------- aggregation
def test_token_weights_and_normalisers():
    masks = [torch.tensor([True, False, True]), torch.tensor([False, False]), torch.tensor([True])]
    b = TokenBatch.from_sequences(masks, torch.zeros(3, dtype=D))
    assert Normalisers.of(b) == Normalisers(num_tokens=3, num_sequences=2)
    assert token_weights(b, "token-mean").tolist() == [1 / 3, 0, 1 / 3, 0, 0, 1 / 3]
    assert token_weights(b, "seq-mean-token-sum").tolist() == [1 / 2, 0, 1 / 2, 0, 0, 1 / 2]
    assert token_weights(b, "seq-mean-token-sum", norm_constant=8.0).tolist() == [1 / 16, 0, 1 / 16, 0, 0, 1 / 16]
    assert token_weights(b, "seq-mean-token-mean").tolist() == [1 / 4, 0, 1 / 4, 0, 0, 1 / 2]
    # A rank's share with global counts.
    w = token_weights(b, "token-mean", Normalisers(num_tokens=12, num_sequences=9))
    assert w.tolist() == [1 / 12, 0, 1 / 12, 0, 0, 1 / 12]
    with pytest.raises(ValueError, match="norm_constant .* seq-mean-token-sum only"):
        token_weights(b, "token-mean", norm_constant=4.0)
    with pytest.raises(ValueError, match="unknown aggregation"):
        token_weights(b, "sum")


def test_normalisers_all_reduce_single_process(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert Normalisers(5, 2).all_reduce() == Normalisers(5, 2)
    finally:
        dist.destroy_process_group()
