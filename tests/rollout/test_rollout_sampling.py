"""Sampling pieces of treerl.rollout on handmade distributions: top-k, top-p, the
sampler's frequencies and logprobs, parameter validation, stop detection."""

import math

import numpy as np
import pytest
import torch

from treerl.rollout import SamplingParams, StopChecker, apply_top_k, apply_top_p, sample, sampling_distribution
from treerl.rollout.sampling import apply_min_p, race_noise, race_reference, race_sample, row_seed, sample_rows

NEG = float("-inf")


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in logits]


def test_top_k_keeps_the_k_largest_and_ties():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0], [0.0, 5.0, 5.0, 1.0, 4.0]], dtype=torch.float64)
    assert kept(apply_top_k(logits, 2)) == [[0, 4], [1, 2]]
    assert kept(apply_top_k(logits, 3)) == [[0, 1, 4], [1, 2, 4]]
    # ties with the k-th largest are kept
    assert kept(apply_top_k(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), 2)) == [[1, 2]]
    assert kept(apply_top_k(torch.tensor([[3.0, 2.0, 2.0, 0.0]]), 2)) == [[0, 1, 2]]
    out = apply_top_k(logits, 2)
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])  # kept values untouched
    assert torch.equal(apply_top_k(logits, 0), logits) and torch.equal(apply_top_k(logits, 5), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)  # ranks: 1, 3, 0, 2
    logits = probs.log()[None].repeat(6, 1)
    ps = [0.3, 0.5, 0.6, 0.79, 0.81, 0.96]
    got = [kept(apply_top_p(logits[i : i + 1], p))[0] for i, p in enumerate(ps)]
    assert got == [[1], [1], [1, 3], [1, 3], [0, 1, 3], [0, 1, 2, 3]]
    assert torch.equal(apply_top_p(logits, 1.0), logits)
    # rows are independent; the top token survives any p
    two = torch.stack([probs.log(), torch.tensor([0.97, 0.01, 0.01, 0.01], dtype=torch.float64).log()])
    assert kept(apply_top_p(two, 0.9)) == [[0, 1, 3], [0]]
    assert kept(apply_top_p(two, 1e-9)) == [[1], [0]]


def test_sampling_distribution_by_hand():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0, 1.5]], dtype=torch.float64)
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.8)
    # by hand: scaled = [2, 4, 1, -2, 3]; top-3 -> {1, 4, 0}; softmax over them:
    e = np.exp([2.0, 4.0, 3.0])
    p = e / e.sum()  # tokens 0, 1, 4 -> 0.090, 0.665, 0.245
    # top-p 0.8: 1 (0.665) then 4 (mass before 0.665 < 0.8) then 0 (mass before 0.91 >= 0.8) dropped
    expected = np.zeros(5)
    expected[[1, 4]] = p[[1, 2]] / (p[1] + p[2])
    assert np.allclose(sampling_distribution(logits, params).numpy()[0], expected, atol=1e-12)


def test_sample_frequencies_match_the_distribution():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 1.5, 0.0], dtype=torch.float32)
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    expected = sampling_distribution(logits[None].double(), params)[0].numpy()
    n = 40000
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample(logits[None].repeat(n, 1), params, gen)
    freq = np.bincount(tokens.numpy(), minlength=6) / n
    sigma = np.sqrt(expected * (1 - expected) / n) + 1e-12
    assert np.all(np.abs(freq - expected) <= 5 * sigma), (freq, expected)
    assert freq[expected == 0].sum() == 0
    # behaviour logprob = log-softmax of the temperature-scaled logits, before truncation
    full = torch.log_softmax(logits / 0.7, -1)
    assert torch.allclose(logp, full[tokens])


def test_greedy_and_seeded_sampling():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tok, lp = sample(logits, SamplingParams(temperature=0))
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0], rtol=0, atol=1e-15)
    p = SamplingParams(temperature=1.0)
    a = sample(logits, p, torch.Generator().manual_seed(5))[0]
    b = sample(logits, p, torch.Generator().manual_seed(5))[0]
    c = sample(logits, p, torch.Generator().manual_seed(6))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=0), "n "),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(stop_token_ids=[600]), "stop token"),
        (dict(stop_strings=["x"]), "decode"),
        (dict(stop_strings="x", decode=str), "sequence of strings"),
        (dict(branch_points=[0]), "branch point"),
        (dict(branch_points=[8], max_new_tokens=8), "branch point"),
        (dict(branch_points=[2, 3], branch_factor=[2]), "branch_factor"),
        (dict(branch_points=[2, 2]), "distinct"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=-1), "top_logprobs"),
    ],
)
def test_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs).validate(vocab_size=512)


def test_branch_schedule_and_leaves():
    p = SamplingParams(n=3, max_new_tokens=10, branch_points=[6, 2], branch_factor=[3, 2]).validate()
    assert p.branch_schedule() == {2: 2, 6: 3} and p.max_leaves == 18
    q = SamplingParams(n=2, max_new_tokens=10, branch_every=4, branch_factor=2).validate()
    assert q.branch_schedule() == {4: 2, 8: 2} and q.max_leaves == 8


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def decode(ids):
    # token t -> one letter, except tokens >= 100 which decode to two letters
    return "".join(LETTERS[t % 26] + (LETTERS[(t + 1) % 26] if t >= 100 else "") for t in ids)


def test_stop_checker_tokens_and_strings():
    toks = np.array([0, 1, 2, 3, 4, 5, 6, 7])  # "abcdefgh"
    assert StopChecker([5], [], None).find(toks, 0) == (6, 5)
    assert StopChecker([5, 2], [], None).find(toks, 0) == (3, 2)
    assert StopChecker([5], [], None).find(toks, 6) is None  # stops before `start` were seen already
    sc = StopChecker([], ["def"], decode)
    assert sc.find(toks, 0) == (6, "def")
    assert sc.find(toks, 5) == (6, "def")  # string straddles the checked boundary
    assert sc.find(toks[:5], 0) is None
    # the earlier of a token and a string stop wins
    assert StopChecker([6], ["cd"], decode).find(toks, 0) == (4, "cd")
    assert StopChecker([2], ["cd"], decode).find(toks, 0) == (3, 2)
    # a stop string completed inside a two-letter token: that token ends the completion
    two = np.array([0, 106, 5])  # "a" "cd" "f"
    assert StopChecker([], ["ac"], decode).find(two, 0) == (2, "ac")
    # the string completed first is reported; at the same token, the one starting first
    assert StopChecker([], ["gh", "bc"], decode).find(toks, 0) == (3, "bc")
    assert StopChecker([], ["c", "bc"], decode).find(toks, 0) == (3, "bc")
    # a string completed by the first unchecked token
    assert StopChecker([], ["bcd"], decode).find(toks, 3) == (4, "bcd")


def test_stop_checker_long_completion_windowed():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 20, size=3000)  # letters a..t only
    toks[2500:2503] = [23, 24, 25]  # "xyz"
    sc = StopChecker([], ["xyz"], decode)
    for start in (0, 2400, 2501, 2502):
        assert sc.find(toks, start) == (2503, "xyz")
    assert sc.find(toks[:2502], 2400) is None
    assert math.isclose(len(decode(toks[:2503].tolist())), 2503)


def test_min_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]], dtype=torch.float64))
    # min_p 0.2: tokens at least 0.2 x 0.5 = 0.1 likely -> {0, 1, 2}
    expected = np.asarray([0.5, 0.3, 0.12, 0.0]) / 0.92
    dist = sampling_distribution(logits, SamplingParams(temperature=1.0, min_p=0.2))
    assert np.allclose(dist.numpy()[0], expected, atol=1e-12)
    assert torch.equal(apply_min_p(logits, 0.0), logits)


def _row_params():
    return [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=3),
            SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=1.0, min_p=0.3),
            SamplingParams(temperature=0.5, top_k=4, top_p=0.9, min_p=0.05), SamplingParams(temperature=2.0)]


def _tensors(ps):
    return (torch.tensor([p.temperature for p in ps], dtype=torch.float64),
            torch.tensor([p.top_p for p in ps], dtype=torch.float64),
            torch.tensor([p.top_k for p in ps]), torch.tensor([p.min_p for p in ps], dtype=torch.float64))


def test_sample_rows_frequencies_match_each_rows_distribution():
    """Each row sampled with its own settings: its frequencies match its own distribution
    (``sampling_distribution``), tokens outside it never come, logprobs are the
    temperature-scaled log-softmax; greedy rows take the argmax."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 12, generator=g, dtype=torch.float64)
    ps, n = _row_params(), 8000
    logits = base.repeat(n, 1)
    tokens, logp = sample_rows(logits, *(t.repeat(n) for t in _tensors(ps)), torch.Generator().manual_seed(0))
    tokens = tokens.view(n, 6)
    assert (tokens[:, 0] == base[0].argmax()).all()
    for i, p in enumerate(ps[1:], 1):
        expected = sampling_distribution(base[i : i + 1], p)[0].numpy()
        freq = np.bincount(tokens[:, i].numpy(), minlength=12) / n
        sigma = np.sqrt(expected * (1 - expected) / n) + 1e-12
        assert np.all(np.abs(freq - expected) <= 5 * sigma), (i, freq, expected)
        assert freq[expected == 0].sum() == 0, i
    scale = torch.tensor([1.0] + [p.temperature for p in ps[1:]], dtype=torch.float64)
    full = torch.log_softmax(logits / scale.repeat(n)[:, None], -1)
    assert torch.allclose(logp, full.gather(-1, tokens.view(-1, 1))[:, 0], rtol=1e-12, atol=0)


def test_seeded_rows_do_not_depend_on_the_batch():
    """A seeded row's sample is the same alone and among other rows (in any position), and
    depends on its seed; unseeded rows use the generator."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 40, generator=g, dtype=torch.float64)
    ps = _row_params()[1:]
    t = _tensors(ps)
    seed = row_seed(7, (0,), 3)
    got = []
    for row in range(5):
        alone = sample_rows(logits[row : row + 1], *(x[row : row + 1] for x in t), seeds={0: seed})[0]
        batch = sample_rows(logits, *t, torch.Generator().manual_seed(row), seeds={row: seed})[0]
        assert batch[row] == alone[0], row
        got.append(alone[0])
    draws = {int(sample_rows(logits[4:5], *(x[4:5] for x in t), seeds={0: row_seed(s, (0,), 3)})[0][0])
             for s in range(40)}
    assert len(draws) > 3  # the seed matters
    assert row_seed(7, (0,), 3) != row_seed(7, (1,), 3) != row_seed(7, (0,), 4)


def test_seeded_noise_is_the_splitmix_hash_of_seed_and_token_and_exponential():
    """Rows' noise, batched in torch int64 (products wrap), equals splitmix64 of (seed,
    token) computed with Python integers (its top 23 bits as u = (2b + 1) / 2^24, E = -log u),
    and is Exp(1) distributed."""
    import math

    mask = (1 << 64) - 1

    def reference(seed: int, token: int) -> float:
        x = (seed + (token + 1) * 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        x ^= x >> 31
        return -math.log((2 * (x >> 41) + 1) / 2**24)

    seeds = [row_seed(7, (0,), 3), row_seed(7, (1,), 3), row_seed(123, (2, 1), 0)]
    noise = race_noise(torch.tensor(seeds), 50_000)
    assert noise.dtype == torch.float32
    for i, seed in enumerate(seeds):
        for token in (0, 1, 777, 49_999):
            assert noise[i, token].item() == pytest.approx(reference(seed, token), rel=3e-7)
    assert (noise[:, 0] != noise[:, 1]).all() and not torch.equal(noise[0], noise[1])
    assert torch.allclose(noise.mean(dim=1), torch.ones(3), atol=0.03)
    assert torch.allclose(noise.var(dim=1), torch.ones(3), atol=0.06)

def test_race_reference_by_hand_and_frequencies():
    """The untruncated race: greedy rows take the argmax (logprob at T = 1), sampled rows
    ``argmax(x / T - log E)`` with the rows' noise, logprob ``log_softmax(x / T)`` at the
    token; over many seeds a row's draws follow ``softmax(x / T)``."""
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.3, -0.2, 0.9, 0.1]], dtype=torch.float64)
    seeds = torch.tensor([11, 12])
    tok, lp = race_reference(logits, torch.tensor([0.0, 0.5]), seeds)
    noise = race_noise(seeds, 4).double()
    assert tok[0] == 1 and tok[1] == (logits[1] / 0.5 - noise[1].log()).argmax()
    assert torch.allclose(lp, torch.stack([torch.log_softmax(logits[0], -1)[1],
                                           torch.log_softmax(logits[1] / 0.5, -1)[tok[1]]]), rtol=1e-14, atol=0)
    n = 40_000
    draws = race_reference(logits[1:].repeat(n, 1), torch.tensor([0.5]), torch.arange(n) * 7919 + 3)[0]
    freq = torch.bincount(draws, minlength=4).double() / n
    expected = torch.softmax(logits[1] / 0.5, -1)
    assert torch.all((freq - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt()), (freq, expected)


def test_race_sample_writes_given_outputs():
    """``race_sample`` (the CPU reference here) writes into given token/logprob tensors, in
    their dtype, and returns them; ``sample`` and ``sample_rows`` without truncation take it."""
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t = torch.tensor([0.0, 1.0, 0.7, 1.0, 2.0], dtype=torch.float64)
    tokens, logp = torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.float32)
    got = race_sample(logits, t, torch.arange(5), tokens, logp)
    assert got[0] is tokens and got[1] is logp
    want = race_reference(logits, t, torch.arange(5))
    assert torch.equal(tokens, want[0]) and torch.allclose(logp.double(), want[1], atol=1e-6)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    ones = torch.ones(5, dtype=torch.float64)
    a = sample_rows(logits, t, ones, torch.zeros(5, dtype=torch.int64), 0 * ones, g1, truncate=False)
    b = race_reference(logits, t, torch.randint(0, 1 << 62, (5,), generator=g2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
