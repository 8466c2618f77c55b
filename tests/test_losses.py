"""Loss module: zeros on equal distributions, TV = 1 - sum min(p, q), temperature, position weights."""

import math

import pytest
import torch

from models.errors import DraftheadsError
from train.losses import Softmax, distill_loss, forward_kl, position_weights, reverse_kl, token_ce, total_variation


def test_equal_distributions_give_zero():
    logits = torch.randn(5, 50)
    for kind in ("fkl", "rkl", "tv", "lk"):
        torch.testing.assert_close(distill_loss(kind, logits, logits.clone(), 0.7), torch.zeros(5), atol=1e-6, rtol=0)


def test_tv_is_one_minus_overlap_and_kl_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.2, 0.2, 0.6]])
    tv = total_variation(p.log(), q.log())
    assert float(tv) == pytest.approx(1 - (0.2 + 0.2 + 0.2)) == pytest.approx(0.5 * float((p - q).abs().sum()))
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p[0].tolist(), q[0].tolist()))
    assert float(forward_kl(p.log(), q.log())) == pytest.approx(kl, rel=1e-5)
    assert float(reverse_kl(p.log(), q.log())) == pytest.approx(float(forward_kl(q.log(), p.log())), rel=1e-6)
    # lk mixes them
    assert float(distill_loss("lk", p.log(), q.log(), tv_weight=0.25)) == pytest.approx(0.75 * kl + 0.25 * 0.4, rel=1e-5)


def test_temperature_applies_to_both_softmaxes():
    p, q = torch.randn(4, 30), torch.randn(4, 30)
    torch.testing.assert_close(forward_kl(p, q, temperature=2.0), forward_kl(p / 2, q / 2))
    assert (forward_kl(p, q, 100.0) < forward_kl(p, q, 1.0)).all()  # high T flattens both towards uniform


def test_position_weights_and_ce():
    depth = torch.tensor([1, 2, 3])
    torch.testing.assert_close(position_weights(depth, "exp", 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert position_weights(depth, "none", 2.0).tolist() == [1.0, 1.0, 1.0]
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    ce = token_ce(logits, torch.tensor([1, -1]))
    assert ce.tolist() == pytest.approx([-math.log(0.75), 0.0])
    with pytest.raises(DraftheadsError, match="position_weighting"):
        position_weights(depth, "linear", 2.0)
    with pytest.raises(DraftheadsError, match="train.loss 'mse'"):
        distill_loss("mse", logits, logits)


@pytest.mark.parametrize("kind", ["fkl", "lk"])
def test_kept_and_recomputed_logits_give_the_same_loss_and_gradient(kind, monkeypatch):
    """A chunk's draft logits are kept for backward when small, recomputed (checkpoint) when large: same numbers."""
    from types import SimpleNamespace

    import train.trainer as trainer

    g = torch.Generator().manual_seed(0)
    lm = torch.nn.Linear(16, 40, bias=False)
    core = SimpleNamespace(logits_for=lambda h, depth: lm(h))
    tc = SimpleNamespace(distill_weight=1.0, loss=kind, lk_tv_weight=0.5, hidden_weight=0.0, ce_weight=0.1,
                         confidence_weight=0.0, temperature=SimpleNamespace(scale_loss=False))
    tgt, labels = torch.randn(6, 40, generator=g), torch.randint(0, 40, (6,), generator=g)
    hidden0 = torch.randn(6, 16, generator=g)
    results = []
    for keep in (0, 2**30):
        monkeypatch.setattr(trainer, "KEEP_LOGITS_BYTES", keep)
        hidden = hidden0.clone().requires_grad_()
        lm.zero_grad()
        part, hit = trainer._chunk_loss(core, hidden, None, Softmax(tgt, 0.7), labels, labels, torch.ones(6), tc, 0.7)
        part.backward()
        results.append((part.detach(), hit, hidden.grad, lm.weight.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_confidence_label_is_acceptance_at_t1_whatever_the_distillation_temperature():
    """DSpark's confidence head learns 1 - TV(p, q) at T = 1 (what serving at T = 1 accepts), not at the annealed
    distillation temperature: a flattened pair agrees more (p=[.9,.1], q=[.5,.5]: 0.60 at T=1, 0.75 at T=2)."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    import train.trainer as trainer
    from train.losses import total_variation

    g = torch.Generator().manual_seed(3)
    lm, conf = torch.nn.Linear(16, 40, bias=False), torch.nn.Linear(16, 1)
    core = SimpleNamespace(logits_for=lambda h, depth: lm(h), confidence_logit=lambda h, depth: conf(h).squeeze(-1))
    tc = SimpleNamespace(distill_weight=0.0, loss="fkl", lk_tv_weight=0.5, hidden_weight=0.0, ce_weight=0.0,
                         confidence_weight=1.0, temperature=SimpleNamespace(scale_loss=False))
    tgt, labels, hidden = torch.randn(6, 40, generator=g), torch.randint(0, 40, (6,), generator=g), torch.randn(6, 16)
    with torch.no_grad():
        label = 1.0 - total_variation(tgt, lm(hidden))
        want = F.binary_cross_entropy_with_logits(conf(hidden).squeeze(-1), label, reduction="sum")
        for temperature in (1.0, 2.0):
            part, _ = trainer._chunk_loss(core, hidden, None, Softmax(tgt, temperature), labels, labels, torch.ones(6),
                                          tc, temperature)
            torch.testing.assert_close(part, want)


@pytest.mark.parametrize("kind", ["fkl", "lk"])
def test_rows_that_share_a_label_position_share_its_softmax_exactly(kind):
    """The trainer computes the target's softmax once per label position and gathers it for every row labelled
    there (Softmax.take): loss, agreement and gradients bitwise those of a softmax over the gathered logits."""
    from types import SimpleNamespace

    import train.trainer as trainer

    g = torch.Generator().manual_seed(1)
    lm = torch.nn.Linear(16, 40, bias=False)
    core = SimpleNamespace(logits_for=lambda h, depth: lm(h))
    tc = SimpleNamespace(distill_weight=1.0, loss=kind, lk_tv_weight=0.5, hidden_weight=0.0, ce_weight=0.1,
                         confidence_weight=0.0, temperature=SimpleNamespace(scale_loss=False))
    positions = torch.randn(4, 40, generator=g)  # 4 label positions, 9 rows
    where = torch.tensor([0, 1, 1, 2, 3, 3, 3, 0, 2])
    labels, hidden0 = torch.randint(0, 40, (9,), generator=g), torch.randn(9, 16, generator=g)
    results = []
    for p in (Softmax(positions, 0.7).take(where), Softmax(positions[where], 0.7)):
        hidden = hidden0.clone().requires_grad_()
        lm.zero_grad()
        part, hit = trainer._chunk_loss(core, hidden, None, p, labels, labels, torch.rand(9, generator=g.manual_seed(2)),
                                        tc, 0.7)
        part.backward()
        results.append((part.detach(), hit, hidden.grad, lm.weight.grad.clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    taken = Softmax(positions, 0.7).take(where)
    assert torch.equal(taken.logits, positions[where]) and taken.temperature == 0.7
