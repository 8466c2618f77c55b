"""Stage-2 RL pieces: many blocks per sequence are scored exactly and trained with inference numerics."""

import json

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from conf.schema import Config
from inference.llama import LlamaForward
from models.checkpoint import load_draft
from models.dspark import dspark_for_target
from models.peagle import DraftCache, peagle_for_target
from tests.test_trainer import make_cfg, tiny_features
from train.chain import agreement, simulate_chain
from train.rl import (BLOCK_SEED, HOLDOUT_SEED, block_batch, block_logits, block_plan, pick_anchors,
                      rl_validation_fn, round_starts, score_blocks)
from train.trainer import collate

K = 4


def blocks(target, B=2, T=30, seed=0):
    """Two random sequences with their features, 3 anchors each (row 1 padded: its last anchor repeats), blocks y."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    out = target(ids)
    items = [{"input_ids": ids[b], "aux_hidden": out.aux_hidden[b], "final_hidden": out.final_hidden[b]}
             for b in range(B)]
    anchors = torch.tensor([[2, 9, 17], [5, 11, 11]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    y = torch.randint(0, 256, (B, 3, K), generator=g)
    contexts = [ids[b, : int(anchors[b][valid[b]].max()) + 2] for b in range(B)]
    return items, contexts, anchors, valid, y


def test_score_blocks_equals_one_forward_per_block(tiny_target):
    items, contexts, anchors, valid, y = blocks(tiny_target)
    got = score_blocks(LlamaForward(tiny_target), contexts, anchors, y)  # [B, M, K, V]
    for b in range(2):
        for m in range(3):
            if not valid[b, m]:
                continue
            a = int(anchors[b, m])
            seq = torch.cat([items[b]["input_ids"][: a + 2], y[b, m, : K - 1]])
            want = tiny_target(seq[None]).logits[0, a + 1:].float()  # after x_{a+1}, then after y_1..y_{K-1}
            torch.testing.assert_close(got[b, m], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["parallel", "chain", "dspark"])
def test_block_training_logits_equal_inference(tiny_target, family):
    torch.manual_seed(0)
    head = dspark_for_target(tiny_target, k=K) if family == "dspark" else \
        peagle_for_target(tiny_target, k=K, num_layers=2, parallel=family == "parallel")
    items, contexts, anchors, valid, y = blocks(tiny_target)
    batch, plan = block_batch(items, contexts, anchors, valid, y)
    got = F.log_softmax(block_logits(head, head(batch, plan), anchors, valid, K), -1)  # [N, K, V], (b, m) order
    n = 0
    for b in range(2):
        for m in range(3):
            if not valid[b, m]:
                continue
            a = int(anchors[b, m])
            fed = iter(y[b, m].tolist())  # chain heads read the drafted tokens back
            inf = head.draft_logits(items[b]["input_ids"][: a + 2], items[b][head.feature][: a + 1], DraftCache(), K,
                                    lambda _logits: torch.tensor(next(fed)))
            want = F.log_softmax(head.full_vocab_logits(inf.float()), -1)
            torch.testing.assert_close(got[n], want, atol=1e-4, rtol=1e-4)
            n += 1
    assert n == got.shape[0] == 5


def test_block_plan_and_anchors():
    plan = block_plan(torch.tensor([[1, 4], [2, 2]]), torch.tensor([[True, True], [True, False]]), k=3)
    assert plan.blocks == [0, 5, 7, 9]
    rows = lambda b: sorted((int(a), int(d)) for a, d, t in zip(plan.anchor[b], plan.depth[b], plan.trained[b]) if t)  # noqa: E731
    assert rows(0) == [(1, 1), (1, 2), (1, 3), (4, 1), (4, 2), (4, 3)]
    assert rows(1) == [(2, 1), (2, 2), (2, 3)]
    for b in range(2):  # every deeper column's predecessor is its own anchor one depth up
        for col in range(5, 9):
            if plan.valid[b, col]:
                p = plan.predecessor[b, col]
                assert plan.anchor[b, p] == plan.anchor[b, col] and plan.depth[b, p] == plan.depth[b, col] - 1
    item = {"input_ids": torch.arange(40), "loss_mask": torch.arange(40) >= 20}
    got = pick_anchors(item, 8, 30, torch.Generator().manual_seed(0))
    assert len(got) == 8 == len(set(got)) and got == sorted(got) and all(18 <= a <= 28 for a in got)


def held_out(target, n=5, T=30):
    """n random sequences (prompt: the first 6 tokens; the last has no trained token, so no usable anchor)."""
    g = torch.Generator().manual_seed(1)
    items = []
    for i in range(n):
        ids = torch.randint(0, 256, (T,), generator=g)
        out = target(ids[None])
        mask = (torch.arange(T) >= 6) & (i < n - 1)
        items.append({"input_ids": ids, "loss_mask": mask, "aux_hidden": out.aux_hidden[0].float(),
                      "final_hidden": out.final_hidden[0].float()})
    return items


def rl_train_cfg(**kw):
    tc = OmegaConf.structured(Config).train
    tc.batch_size, tc.rl_anchors, tc.rl_max_context = 2, 4, 30
    for key, v in kw.items():
        tc[key] = v
    return tc


def test_rl_validation_is_reproducible_covers_the_holdout_and_tracks_the_head(tiny_target):
    torch.manual_seed(0)
    head = peagle_for_target(tiny_target, k=K, num_layers=1, parallel=False)
    items = held_out(tiny_target)
    validate = rl_validation_fn(head, tiny_target, items, rl_train_cfg(), K, tiny_target.device)
    first = validate()
    torch.rand(10)  # the global RNG plays no part
    assert validate() == first
    # T = the schedule's end (1); 4 sequences x 4 anchors in 3 chunks of <= 2, the anchor-less one skipped
    assert first["val_serve_temperature"] == 1.0 and first["val_blocks"] == 16
    assert 0 < first["val_expected_accepted"] <= K and 0 <= first["val_reward"] <= K
    assert all(0 < first[f"val_alpha_{d}"] <= 1 for d in range(1, K + 1))
    # measured: near-uniform random head and target at T=1 agree a lot (alpha ~0.91, E[accepted] ~3.2)
    assert first["val_expected_accepted"] > 2.5 and first["val_reward"] > 2.0, first
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p))
    other = validate()
    assert other["val_expected_accepted"] != first["val_expected_accepted"]
    assert other["val_reward"] != first["val_reward"], (first, other)


def test_rl_validation_equals_greedy_acceptance_by_hand(tiny_target):
    """At T=0 the blocks are the head's argmax chain: recompute alpha (head softmax at the surrogate T on the target's
    argmax), E[accepted] and the greedy accepted length from plain inference and target forwards, block by block."""
    torch.manual_seed(0)
    head = peagle_for_target(tiny_target, k=K, num_layers=1, parallel=False).eval()
    items = held_out(tiny_target)
    tc = rl_train_cfg(rl_temperature=0.0, rl_surrogate_temperature=0.5)
    got = rl_validation_fn(head, tiny_target, items, tc, K, tiny_target.device)()
    alphas, expected, reward = [], [], []
    with torch.no_grad():
        for chunk, start in enumerate(range(0, len(items), tc.batch_size)):
            g = torch.Generator().manual_seed(tc.seed * BLOCK_SEED + HOLDOUT_SEED + chunk)
            for item in items[start: start + tc.batch_size]:
                ids = item["input_ids"]
                for a in pick_anchors(item, tc.rl_anchors, tc.rl_max_context, g):  # greedy: g draws only anchors
                    q = head.full_vocab_logits(head.draft_logits(ids[: a + 2], item["aux_hidden"][: a + 1],
                                                                 DraftCache(), K, lambda logits: logits.argmax()))
                    y = q.argmax(-1)  # [K]
                    best = tiny_target(torch.cat([ids[: a + 2], y[:-1]])[None]).logits[0, a + 1:].argmax(-1)  # [K]
                    alpha = F.softmax(q.float() / 0.5, -1)[torch.arange(K), best]
                    alphas.append(alpha)
                    reached = torch.cat([torch.ones(1), (y == best).float().cumprod(0)[:-1]])  # greedy prefix right
                    expected.append(float((alpha * reached).sum()))
                    reward.append(int((y == best).long().cumprod(0).sum()))
    assert got["val_blocks"] == len(expected) == 16 and got["val_serve_temperature"] == 0.0
    assert got["val_expected_accepted"] == pytest.approx(sum(expected) / 16, abs=2e-6)
    assert got["val_reward"] == pytest.approx(sum(reward) / 16, abs=1e-6)
    for d in range(K):
        assert got[f"val_alpha_{d + 1}"] == pytest.approx(float(torch.stack(alphas)[:, d].mean()), abs=2e-6)


def test_round_start_anchors_are_the_greedy_chains_rounds(tiny_target):
    """rl_anchor_policy=round_starts draws anchors only where the head's simulated greedy chain starts a round."""
    torch.manual_seed(0)
    head = peagle_for_target(tiny_target, k=K, num_layers=1, parallel=True)
    items = held_out(tiny_target)[:4]
    starts = round_starts(head, tiny_target, items, K, 30, "cpu")
    hit = agreement(head, tiny_target, collate(items, "cpu"), K)
    for b, it in enumerate(items):
        want = [t for t, _ in simulate_chain(hit[b], it["loss_mask"])]
        assert starts[b].nonzero().flatten().tolist() == want
        assert want[0] == 4  # the first round drafts the first answer token (6) from the prompt's last anchor
        got = pick_anchors(it, 3, 30, torch.Generator().manual_seed(b), among=starts[b])
        assert len(got) == 3 and set(got) <= set(want)
    short = round_starts(head, tiny_target, items, K, 16, "cpu")
    assert all(s.nonzero().max() < 16 for s in short)


@pytest.mark.parametrize("policy", ["uniform", "round_starts"])
def test_rl_run_logs_the_held_out_objective_before_and_after(tiny_target, tmp_path, policy):
    """The trainer's RL validation merges val_tau_est and val_tau_chain with the on-policy objective, at step 0 and at
    the end, and the logged numbers are rl_validation_fn's on the stage-1 and final heads."""
    from train.trainer import train_draft

    feats = tiny_features(tiny_target, n=6)
    cfg = make_cfg(tmp_path, steps=2, rl_steps=2, rl_lr=1e-2, stages=["soft_label", "rl"], rl_max_context=30,
                   rl_anchors=4, holdout_sequences=2, eval_every=100, rl_anchor_policy=policy)
    train_draft(cfg, tiny_target, feats, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r["stage"] == "rl" and "val_expected_accepted" in r]
    assert [r["step"] for r in val] == [0, 2]
    steps = [r for r in rows if r["stage"] == "rl" and "loss" in r]  # the serving T, not the unused schedule's
    assert steps and all("temperature" not in r and "serve_temperature" in r for r in steps)
    for row, head_dir in zip(val, ("head_soft_label", "head")):
        assert {"val_tau_est", "val_tau_chain", "val_reward", "val_alpha_1", "val_alpha_3",
                "val_serve_temperature"} <= set(row)
        head = load_draft(tmp_path / head_dir, tiny_target).eval()
        again = rl_validation_fn(head, tiny_target, feats[-2:], cfg.train, 3, tiny_target.device)()
        assert {k: row[k] for k in again} == pytest.approx(again, abs=2e-6)
    assert val[0]["val_expected_accepted"] != val[1]["val_expected_accepted"]


def test_expected_accepted_is_unbiased_when_acceptance_depends_on_the_prefix():
    """K=2, p_1 = (1, 0), q_1 = (1/2, 1/2); after y_1 = 0 the second draft always passes, after y_1 = 1 never. The exact
    rule accepts y_1 = 0 only, so E[accepted] = 1/2 + 1/2 * 1 = 1; the mean over both draws must be 1 (prod alpha: 0.75)."""
    from train.rl import expected_accepted

    alpha = torch.tensor([[0.5, 1.0], [0.5, 0.0]])  # the two equally likely draws y_1 = 0, y_1 = 1
    p_tok = torch.tensor([[1.0, 0.3], [0.0, 0.3]])
    q_tok = torch.tensor([[0.5, 0.3], [0.5, 0.6]])
    assert expected_accepted(alpha, p_tok, q_tok).mean().item() == pytest.approx(1.0)
    assert alpha.cumprod(1).sum(1).mean().item() == pytest.approx(0.75)  # the biased estimate it replaces


def test_the_rl_gradient_is_the_gradient_of_expected_accepted():
    """Blocks drawn from the head: in exact expectation over every (y1, y2) (V=3, K=2, a chain head whose q2 and the
    target's p2 depend on y1), the pathwise gradient plus draw_score equals the gradient of the true E[accepted] =
    alpha_1 + sum_y1 min(p1, q1)(y1) alpha_2(y1); the pathwise gradient alone does not."""
    import itertools

    from inference.verify import acceptance_rates
    from train.rl import accepted_terms, draw_score

    g = torch.Generator().manual_seed(1)
    V = 3
    th1, th2 = torch.randn(V, generator=g).requires_grad_(), torch.randn(V, V, generator=g).requires_grad_()
    p1, p2 = torch.softmax(torch.randn(V, generator=g), 0), torch.softmax(2 * torch.randn(V, V, generator=g), 1)
    q1, q2 = torch.softmax(th1, 0), torch.softmax(th2, 1)  # q2[y1]

    def grad(f):
        return torch.cat([x.flatten() for x in torch.autograd.grad(f, (th1, th2), retain_graph=True)])

    true = grad(acceptance_rates(p1, q1) + (torch.minimum(p1, q1) * acceptance_rates(p2, q2)).sum())
    ours, pathwise = torch.zeros_like(true), torch.zeros_like(true)
    for y1, y2 in itertools.product(range(V), range(V)):
        w = float((q1[y1] * q2[y1, y2]).detach())
        alpha = torch.stack([acceptance_rates(p1, q1), acceptance_rates(p2[y1], q2[y1])])[None]
        q_tok = torch.stack([q1[y1], q2[y1, y2]])[None]
        terms = accepted_terms(alpha, torch.stack([p1[y1], p2[y1, y2]])[None], q_tok)
        pathwise += w * grad(terms.sum())
        ours += w * grad(terms.sum() + draw_score(terms, q_tok.log()).sum())
    torch.testing.assert_close(ours, true, atol=1e-6, rtol=1e-5)
    assert (pathwise - true).abs().max() > 0.01


def test_nothing_counts_after_a_drafted_end_of_turn():
    """The runtime cuts a chain draft after its first end-of-turn token: depths after it are not drafted, so they
    add neither to E[accepted] nor to the exact rule's count."""
    from train.rl import accepted_terms, drafted, exact_accepted

    y = torch.tensor([[5, 2, 7, 8], [5, 6, 7, 2], [2, 2, 2, 2]])
    live = drafted(y, torch.tensor([2]))
    assert live.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    ones = torch.ones(3, 4)
    assert accepted_terms(ones, ones, ones, live).sum(1).tolist() == [2.0, 4.0, 1.0]
    assert exact_accepted(ones, ones, torch.Generator().manual_seed(0), live).tolist() == [2, 4, 1]


def test_depth_acceptance_stats_count_drafted_depths_only():
    """alpha_k is averaged over the blocks that draft depth k: a block cut by an end of turn does not pull it down."""
    from types import SimpleNamespace

    from train.loop import Tally
    from train.rl import acceptance_stats, drafted

    y = torch.tensor([[5, 2, 7, 8], [5, 6, 7, 2], [2, 2, 2, 2]])
    alpha = torch.tensor([[0.5, 0.4, 0.0, 0.0], [0.3, 0.2, 0.6, 0.9], [0.1, 0.0, 0.0, 0.0]])
    r = SimpleNamespace(alpha=alpha, live=drafted(y, torch.tensor([2])), reward=torch.zeros(3),
                        expected=torch.zeros(3))
    tally = Tally()
    tally.update(acceptance_stats(r, 1.0))
    means = tally.means()
    assert [round(means[f"alpha_{d}"], 6) for d in range(1, 5)] == [0.3, 0.3, 0.6, 0.9]


def test_rl_keeps_training_a_dspark_confidence_head(tiny_target):
    """A DSpark head's confidence c_k learns, during RL too, the acceptance of the blocks it drafts: its label is
    alpha_k at T=1 (at serving T=1 the objective's own alpha), and the BCE reaches the confidence weights."""
    from inference.llama import compact_forward
    from train.rl import rl_step_fn, rollout

    torch.manual_seed(0)
    head = dspark_for_target(tiny_target, k=K)
    items = [it for it in held_out(tiny_target) if pick_anchors(it, 4, 30, torch.Generator())]
    tc = rl_train_cfg(rl_temperature=1.0, rl_kl_weight=0.0)
    g = torch.Generator().manual_seed(0)
    r = rollout(head, head, compact_forward(tiny_target), items[:2], [pick_anchors(it, 4, 30, g) for it in items[:2]],
                tc, K, 1.0, g, tiny_target.device)
    assert r.confidence.shape == r.alpha.shape
    torch.testing.assert_close(r.survive, r.alpha.detach())
    loss, stats = rl_step_fn(head, None, tiny_target, items, tc, K, tiny_target.device)(head, 0, 1.0)
    loss.backward()
    assert stats["confidence_loss"] > 0 and head.confidence.weight.grad.abs().sum() > 0
    head.zero_grad(set_to_none=True)
    tc.confidence_weight = 0.0
    loss, stats = rl_step_fn(head, None, tiny_target, items, tc, K, tiny_target.device)(head, 0, 1.0)
    loss.backward()
    assert "confidence_loss" not in stats and head.confidence.weight.grad is None


def test_blocks_are_drawn_under_the_loss_forwards_mixed_precision(tiny_target, monkeypatch):
    """With bf16 mixed precision the loss reads q from the autocast forward (accelerate wraps it); the blocks were
    drawn in fp32 from the bare head, so they were not draws from that q. Now they are drawn under the same autocast
    (train_rl passes accelerator.autocast)."""
    import functools

    from train.rl import rl_step_fn

    head = peagle_for_target(tiny_target, k=3, parallel=False)
    items = [it for it in held_out(tiny_target) if pick_anchors(it, 4, 30, torch.Generator())]
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)

    def model(*args):  # what accelerator.prepare makes of the head under mixed_precision=bf16
        with autocast():
            return head(*args)

    seen = {}

    def noting(name, fn):  # fn, noting whether autocast is on when it runs
        def call(*args):
            seen.setdefault(name, torch.is_autocast_enabled("cpu"))
            return fn(*args)
        return call

    monkeypatch.setattr(head, "draft_logits", noting("draws", head.draft_logits))
    monkeypatch.setattr(head, "train_forward", noting("loss", head.train_forward))
    rl_step_fn(head, None, tiny_target, items, rl_train_cfg(rl_temperature=1.0, rl_kl_weight=0.0), 3,
               tiny_target.device, autocast=autocast)(model, 0, 1.0)
    assert seen == {"draws": True, "loss": True}


def test_rl_validation_gives_every_rank_the_same_rollout_calls(tiny_target, monkeypatch):
    """A chunk whose sequences have no anchor is left out before the chunks are split over ranks: a rank that skipped
    its rollouts would leave the other in a collective forward (DDP buffers, FSDP gathers) alone."""
    import train.rl as rl
    from train.loop import Shard

    items = held_out(tiny_target, n=5)
    items = items[-1:] * 2 + items[:2] + items[-1:] * 2 + items[2:4]  # chunks 0, 2: anchor-less; 1, 3: usable
    head = peagle_for_target(tiny_target, k=K, num_layers=1, parallel=False)
    validate = rl_validation_fn(head, tiny_target, items, rl_train_cfg(), K, tiny_target.device)
    calls = []
    real_rollout = rl.rollout
    monkeypatch.setattr(rl, "rollout", lambda *a, **kw: calls.append(1) or real_rollout(*a, **kw))
    whole = validate()
    assert len(calls) == 2 and whole["val_blocks"] == 16
    for rank in (0, 1):
        calls.clear()
        validate(shard=Shard(rank, 2))
        assert len(calls) == 1
