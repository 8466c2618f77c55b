"""K schedules, the confidence prefix scheduler, group planning, the source selector; all lossless."""

import time

import torch

from inference.runtime import Runtime
from inference.schedulers import ConfidencePrefix, DynamicK, SourceSelector, VerifyCost, plan_groups
from inference.sources.select import SelectSource
from inference.sources.base import Draft
from tests.test_runtime import OracleSource, make_prompts, reference


def test_dynamic_k_rules():
    s = DynamicK(k=4, k_max=8)
    for _ in range(4):
        s.update(4, 4)  # 16 draft tokens, all accepted: 100% -> +2
    assert s.k == 6
    for _ in range(4):
        s.update(4, 0)  # window 32: 16/32 = 50% -> -1
    assert s.k == 5
    for _ in range(8):
        s.update(4, 0)  # window 64 (the cap): 16/64 = 25% -> -2 twice
    assert s.k == 2 and s.history == [4, 6, 5, 3, 2]
    for _ in range(40):
        s.update(4, 4)
    assert s.k == 8  # clamped to k_max
    assert [DynamicK.verdict(r) for r in (0.9, 0.8, 0.7, 0.6, 0.49)] == [2, 0, 0, -1, -2]


def test_dynamic_k_hysteresis_needs_two_verdicts():
    s = DynamicK(k=4, k_max=8, hysteresis=True)
    for _ in range(4):
        s.update(4, 4)
    assert s.k == 4  # first +2 verdict: wait
    for _ in range(4):
        s.update(4, 4)
    assert s.k == 6  # second +2 in a row: move
    for _ in range(4):
        s.update(4, 1)  # window 48: 36/48 = 75% -> 0 resets the pending verdict
    for _ in range(4):
        s.update(4, 0)  # 36/64 = 56% -> -1, first time: wait
    assert s.k == 6


def test_confidence_prefix_admits_by_tokens_per_second():
    cost = VerifyCost([1, 2, 4, 8], [1.0, 1.1, 1.3, 2.0])
    sched = ConfidencePrefix(cost)
    # E/cost: n=0 1.0, n=1 1.9/1.1, n=2 2.71/1.2, n=3 3.115/1.3 = 2.396, n=4 3.1555/1.475 = 2.139 -> stop at 3
    assert sched.keep([0.9, 0.9, 0.5, 0.1, 0.99]) == 3
    assert sched.keep([0.05, 0.9]) == 0  # a hopeless first token: verify the anchor alone
    d = sched.truncate(Draft(torch.tensor([5, 6, 7, 8]), confidences=torch.tensor([0.9, 0.9, 0.5, 0.1])))
    assert d.tokens.tolist() == [5, 6, 7] and d.confidences.numel() == 3
    tree = Draft(torch.tensor([5, 6]), parents=torch.tensor([-1, -1]))
    assert sched.truncate(tree) is tree
    assert abs(cost(3) - 1.2) < 1e-9 and abs(cost(16) - 3.4) < 1e-9  # interpolated / extrapolated


def test_confidence_prefix_learns_acceptance_without_confidences():
    cost = VerifyCost([1, 2, 4, 8], [1.0, 1.1, 1.3, 2.0])
    sched = ConfidencePrefix(cost, explore_every=4)
    draft = Draft(torch.tensor([5, 6, 7, 8]))
    assert sched.measured(2) == [0.5, 0.5]
    assert sched.truncate(draft).size == 2  # prior 1/2: E/cost 1.5/1.1, 1.75/1.2 = 1.458, 1.875/1.3 = 1.442: stop
    for _ in range(30):
        sched.update(4, 0)  # the source is always wrong at position 0
    assert sched.measured(1)[0] < 0.05 and sched.tested[0][1] == 0  # position 1 was never verified
    sizes = [sched.truncate(draft).size for _ in range(4)]
    assert sizes == [0, 0, 4, 0]  # draft skipped (verify the anchor alone), except the exploring call
    assert sched.truncate(draft, key=1).size == 2  # another request: its own statistics (the prior)
    for _ in range(200):
        sched.update(4, 4)  # the source got good: whole drafts accepted
    assert sched.truncate(draft).size == 4
    sched.reset()
    assert sched.measured(2) == [0.5, 0.5]


def test_plan_groups_splits_only_when_padding_costs_more():
    linear = VerifyCost([1, 2], [2.0, 3.0])  # 1 + n seconds
    assert plan_groups([2, 9, 2, 9], linear) == [[0, 2], [1, 3]]  # (1+4) + (1+18) = 24 < 1+36 = 37
    flat = VerifyCost([1, 64], [10.0, 10.6])  # a launch-bound GPU: padding is almost free
    assert plan_groups([2, 9, 2, 9], flat) == [[0, 2, 1, 3]]


def test_selector_prefers_more_tokens_per_second():
    sel = SourceSelector(["a", "b"], warmup=2)
    for _ in range(2):
        i = sel.choose()
        sel.record_draft(i, 0.01)
        sel.record_verify(i, 4, 0.1)  # a: ~36 tok/s
    for _ in range(2):
        i = sel.choose()
        sel.record_verify(i, 1, 0.1)  # b: 10 tok/s
    assert sel.rounds == [2, 2] and sel.choose() == 0
    for _ in range(60):  # a degrades: 1 token per 0.5 s -> b wins
        sel.record_verify(0, 1, 0.5)
    assert sel.choose() == 1


def test_selector_retries_a_source_whose_score_went_stale():
    """b has one slow spell, then is fast again: only a retry can find out, and then it wins."""
    sel = SourceSelector(["a", "b"], warmup=1, explore_every=8)
    speed = {0: (2, 0.1), 1: (1, 1.0)}  # b's spell: 1 token per second
    picks = []
    for step in range(60):
        i = sel.choose()
        picks.append(i)
        sel.record_verify(i, *speed[i])
        if step == 5:
            speed[1] = (5, 0.1)  # b recovers: 50 tok/s against a's 20
    assert picks[:10].count(1) <= 2 and picks[-20:].count(1) >= 17  # a is still retried now and then


class FixedSource:
    """Drafts `tokens(k)` every round after `delay` seconds: a source the selector must learn to avoid."""

    needs_features = False

    def __init__(self, name, tokens, delay=0.0):
        self.name, self.tokens, self.delay = name, tokens, delay

    def reset(self):
        pass

    def propose(self, ctx, k, sampling):
        time.sleep(self.delay)
        return Draft(self.tokens(k))


def wrong_source():  # always wrong, always slow (a margin over timing noise on a loaded machine)
    return FixedSource("wrong", lambda k: torch.full((k,), 2, dtype=torch.long), delay=0.005)


def test_schedulers_are_lossless_through_the_runtime(tiny_target):
    prompts = make_prompts((5, 13), seed=3)
    ref = reference(tiny_target, prompts, 40)
    rt = Runtime(tiny_target, max_len=128, batch_size=2)
    oracle = OracleSource(prompts, ref)
    g = rt.generate(prompts, 40, source=oracle, schedule=lambda: DynamicK(k=3, k_max=7), ignore_eos=True)
    assert g.tokens == ref
    prefix = ConfidencePrefix(VerifyCost([1, 2, 8], [1.0, 1.05, 1.4]))
    g = rt.generate(prompts, 40, source=oracle, k=6, prefix=prefix, ignore_eos=True)
    assert g.tokens == ref and min(prefix.kept) < max(prefix.kept)  # it did cut some drafts
    select = SelectSource([wrong_source(), oracle], "select:wrong+oracle", warmup=2)
    g = rt.generate(prompts, 40, select, k=4, ignore_eos=True)
    assert g.tokens == ref and select.selector.picks[1] > 2 * select.selector.picks[0]


def test_selector_charges_rounds_without_a_draft(tiny_target, monkeypatch):
    prompts = make_prompts((5, 13), seed=3)
    ref = reference(tiny_target, prompts, 40)
    empty = FixedSource("empty", lambda k: torch.empty(0, dtype=torch.long))
    select = SelectSource([empty, OracleSource(prompts, ref)], "select:empty+oracle", warmup=2)
    ticks = iter(range(10**6))  # every timed span lasts one tick: a stall on a loaded machine cannot decide the picks
    monkeypatch.setattr("inference.runtime.time.perf_counter", lambda: float(next(ticks)))
    g = Runtime(tiny_target, max_len=128, batch_size=2).generate(prompts, 40, select, k=4, ignore_eos=True)
    assert g.tokens == ref and select.selector.rounds[0] == 2  # tried, charged, then left alone
    assert select.selector.picks[1] > 5 * select.selector.picks[0]


def test_select_hears_about_every_draft_even_one_the_prefix_scheduler_cut(tiny_target):
    prompts = make_prompts((5, 13), seed=3)
    ref = reference(tiny_target, prompts, 40)
    select = SelectSource([wrong_source(), OracleSource(prompts, ref)], "select:wrong+oracle", warmup=2)
    prefix = ConfidencePrefix(VerifyCost([1, 2, 8], [1.0, 1.05, 1.4]))
    g = Runtime(tiny_target, max_len=128, batch_size=2).generate(prompts, 40, select, k=6, prefix=prefix,
                                                                   ignore_eos=True)
    assert g.tokens == ref and min(prefix.kept) < 6  # some drafts were cut (new Draft objects)
    assert sum(select.selector.rounds) == sum(select.selector.picks) > 20  # every pick was reported to its part


def test_select_spec_builds_and_stays_lossless(tiny_target):
    from inference.sources import build_source

    prompts = make_prompts((9, 11), seed=5)
    ref = reference(tiny_target, prompts, 30)
    source = build_source("select:prompt_lookup+prompt_lookup:max_ngram=2,min_ngram=1", tiny_target)
    g = Runtime(tiny_target, max_len=128, batch_size=2).generate(prompts, 30, source, k=3, ignore_eos=True)
    assert g.tokens == ref and sum(r["rounds"] for r in source.report()) > 0


def test_auto_threads_leave_busy_cpus_alone():
    import os

    from inference.threads import CompetingLoad, available_threads, busy_cpus

    assert available_threads(3) == 3
    cpus = len(os.sched_getaffinity(0))
    with CompetingLoad(cpus + 1):  # more busy processes than CPUs: still one thread
        assert busy_cpus() >= 1 and available_threads() == 1
