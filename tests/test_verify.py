"""The verifier: greedy acceptance on fake logits, and the rejection sampler's output distribution."""

import pytest
import torch

from inference.sampling import SamplingConfig
from inference.sources.base import Draft
from inference.stats import DecodeStats
from inference.verify import accept_greedy, acceptance_rates, verify_chain

V = 8
P1 = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])  # target at draft position 1
P2 = torch.tensor([0.05, 0.05, 0.40, 0.10, 0.10, 0.10, 0.10, 0.10])  # target at position 2 (and the bonus)
Q1 = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.05, 0.05, 0.05, 0.05])  # draft at position 1
Q2 = torch.tensor([0.30, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10])
SAMPLE = SamplingConfig(temperature=1.0)


def fake_logits(argmax_tokens: list[int], vocab: int = V) -> torch.Tensor:
    """[len, V] logits whose argmax at row j is argmax_tokens[j]."""
    logits = torch.randn(len(argmax_tokens), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmax_tokens)), argmax_tokens] = 10.0
    return logits


def chi_square_pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    n = counts.sum()
    expected = n * p
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((p.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat.double() / 2))  # chi2 survival function


@pytest.mark.parametrize("draft, n_expected, next_expected", [
    ([3, 1, 4], 3, 5),  # always right: all accepted, bonus = argmax of the last row
    ([0, 1, 4], 0, 3),  # wrong first token: nothing accepted, the target's token instead
    ([3, 1, 2], 2, 4),  # sometimes: two accepted, correction at position 3
])
def test_greedy_fake_logits(draft, n_expected, next_expected):
    logits = fake_logits([3, 1, 4, 5])  # target argmax per position, last row = bonus
    assert accept_greedy(torch.tensor(draft), logits) == (n_expected, next_expected)
    # same answer through verify_chain, with or without draft probabilities (greedy ignores q)
    probs = torch.full((3, V), 1.0 / V)
    for q in (None, probs):
        assert verify_chain(Draft(torch.tensor(draft), q), logits, SamplingConfig()) == (n_expected, next_expected)


def test_empty_draft_is_one_plain_step():
    logits = fake_logits([6])
    assert verify_chain(Draft(torch.empty(0, dtype=torch.long)), logits, SamplingConfig()) == (0, 6)
    n, token = verify_chain(Draft(torch.empty(0, dtype=torch.long)), logits, SAMPLE, torch.Generator().manual_seed(0))
    assert n == 0 and 0 <= token < V


def test_verify_chain_rejects_wrong_shapes_and_trees():
    with pytest.raises(ValueError, match="expected k\\+1"):
        verify_chain(Draft(torch.tensor([1, 2])), fake_logits([1, 2]), SamplingConfig())
    with pytest.raises(ValueError, match="tree"):
        verify_chain(Draft(torch.tensor([1]), parents=torch.tensor([-1])), fake_logits([1, 2]), SamplingConfig())


def run_rejection(q_rows, n_samples=20_000, seed=0, sampling=SAMPLE, target_logits=None):
    """Sample chain drafts from q_rows (None row = point mass on token 1), verify; emitted token counts per position."""
    k = len(q_rows)
    gen = torch.Generator().manual_seed(seed)
    logits = target_logits if target_logits is not None else torch.stack([P1, P2, P2][: k + 1]).log()
    counts = torch.zeros(k + 1, V)
    n_accepted = torch.zeros(k + 1)
    for _ in range(n_samples):
        tokens = torch.stack([torch.multinomial(q, 1, generator=gen)[0] if q is not None else torch.tensor(1)
                              for q in q_rows])
        probs = None if any(q is None for q in q_rows) else torch.stack(q_rows)
        n, nxt = verify_chain(Draft(tokens, probs), logits, sampling, gen)
        emitted = tokens[:n].tolist() + [nxt]
        for j, t in enumerate(emitted):
            counts[j, t] += 1
        n_accepted[n] += 1
    return counts, n_accepted


def test_rejection_sampling_emits_target_distribution():
    counts, n_accepted = run_rejection([Q1, Q2])
    assert counts[0].sum() == 20_000
    assert chi_square_pvalue(counts[0], P1) > 1e-3  # first emitted token ~ p1
    assert chi_square_pvalue(counts[1], P2) > 1e-3  # second ~ p2 (accepted draft, resample or bonus)
    # the test has power: the draft distribution itself is rejected by a mile
    assert chi_square_pvalue(counts[0], Q1) < 1e-12
    # acceptance at position 1 happens with probability alpha_1 = sum min(p1, q1)
    alpha = acceptance_rates(torch.stack([P1, P2]), torch.stack([Q1, Q2]))
    assert alpha[0].item() == pytest.approx(0.57)
    assert (n_accepted[1:].sum() / 20_000).item() == pytest.approx(alpha[0].item(), abs=0.015)


def test_rejection_with_point_mass_draft():
    counts, n_accepted = run_rejection([None], n_samples=20_000, seed=1)
    assert chi_square_pvalue(counts[0], P1) > 1e-3
    # a point mass on token 1 is accepted with probability p1(1) = 0.2
    assert (n_accepted[1] / 20_000).item() == pytest.approx(0.2, abs=0.01)


def test_rejection_respects_top_k():
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    logits = torch.stack([P1, P2]).log()
    p = sampling.probs(logits[0])
    assert (p > 0).sum() == 3
    counts, _ = run_rejection([Q1], n_samples=20_000, seed=2, sampling=sampling, target_logits=logits)
    assert counts[0][p == 0].sum() == 0  # never emits a token outside the top-k
    assert chi_square_pvalue(counts[0][p > 0], p[p > 0]) > 1e-3


def test_round_outcomes_per_depth():
    stats = DecodeStats(k=4)
    stats.record_round(4, 2, 4)  # a chain of 4, 2 accepted: depths 0..2 verified, 0..1 accepted
    assert [stats.tested[j] for j in range(4)] == [1, 1, 1, 0] and [stats.accepted[j] for j in range(4)] == [1, 1, 0, 0]
    stats.record_round(4, 4, 4)
    assert [stats.tested[j] for j in range(4)] == [2, 2, 2, 1] and [stats.accepted[j] for j in range(4)] == [2, 2, 1, 1]
    stats.emitted = 3 + 5
    total = stats + stats
    assert total.summary()["acceptance"] == [1.0, 1.0, 0.5, 1.0]
    assert total.tau == 4.0 and total.accept_hist == {2: 2, 4: 2}
