"""How much to draft, and with what: K schedules, the confidence prefix scheduler, a source selector.

All of them only choose or truncate drafts, never change a token, so every one of them is lossless by
construction (tests/test_schedulers.py checks greedy equality through the runtime anyway).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from inference.sources.base import Draft


class FixedK:
    def __init__(self, k: int):
        self.k = k

    def update(self, proposed: int, accepted: int) -> None:
        pass


class DynamicK:
    """K from a sliding acceptance window: the last `window` draft tokens, re-evaluated every `every`
    of them. Acceptance = accepted / proposed. >85% -> +2, 70-85% -> 0, 50-70% -> -1, <50% -> -2,
    clamped to [k_min, k_max]. With hysteresis a change needs the same verdict twice in a row."""

    def __init__(self, k: int = 4, k_min: int = 2, k_max: int = 8, window: int = 64, every: int = 16,
                 hysteresis: bool = False):
        self.k, self.k_min, self.k_max, self.every, self.hysteresis = k, k_min, k_max, every, hysteresis
        self.window: deque[int] = deque(maxlen=window)
        self.since = 0
        self.pending = 0  # last verdict (hysteresis)
        self.history: list[int] = [k]

    @staticmethod
    def verdict(rate: float) -> int:
        if rate > 0.85:
            return 2
        if rate >= 0.70:
            return 0
        if rate >= 0.50:
            return -1
        return -2

    def update(self, proposed: int, accepted: int) -> None:
        self.window.extend([1] * accepted + [0] * (proposed - accepted))
        self.since += proposed
        if self.since < self.every or not self.window:
            return
        self.since = 0
        delta = self.verdict(sum(self.window) / len(self.window))
        if self.hysteresis:
            delta, self.pending = (delta if delta == self.pending else 0), delta
        self.k = max(self.k_min, min(self.k_max, self.k + delta))
        self.history.append(self.k)


@dataclass
class VerifyCost:
    """Seconds for one target forward over n tokens, measured at `sizes` (Runtime.profile_cost);
    linear in between and beyond the last size."""

    sizes: list[int]
    seconds: list[float]

    def __call__(self, n: float) -> float:
        xs, ys = self.sizes, self.seconds
        if n <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
        return ys[-1] + slope * (n - xs[-1])


class ConfidencePrefix:
    """DSpark's confidence prefix scheduler. Token j survives with s_j = prod_{i<=j} confidences_i, so a
    prefix of n drafts emits E(n) = 1 + sum_{j<=n} s_j tokens per verification costing cost(1 + n). Admit
    drafts greedily while E/cost (tokens per second) still rises; stop at the first that lowers it. Only
    truncates: lossless. Trees pass through unchanged.

    Drafts without confidences (prompt lookup, draft files) use the measured conditional acceptance per
    position instead, per request (`key`; exponentially weighted, prior 1/2, fed by the runtime through
    `update`, cleared by `reset` at each generate call); every `explore_every`-th such draft of a request is
    kept whole so a request whose drafts got better is noticed again."""

    def __init__(self, cost: VerifyCost, min_keep: int = 0, explore_every: int = 8, decay: float = 0.98):
        self.cost, self.min_keep, self.explore_every, self.decay = cost, min_keep, explore_every, decay
        self.kept: list[int] = []
        self.tested: dict[int, list[float]] = {}  # key -> per position j: weighted rounds where j was verified
        self.accepted: dict[int, list[float]] = {}  # ... and accepted
        self.unconfident: dict[int, int] = {}

    def reset(self) -> None:
        self.tested, self.accepted, self.unconfident = {}, {}, {}

    def keep(self, confidences: list[float]) -> int:
        survival, expected = 1.0, 1.0
        best = expected / self.cost(1)
        n = 0
        for j, c in enumerate(confidences, start=1):
            survival *= float(c)
            rate = (expected + survival) / self.cost(1 + j)
            if rate <= best and j > self.min_keep:
                break
            expected, best, n = expected + survival, max(best, rate), j
        return n

    def measured(self, k: int, key: int = 0) -> list[float]:
        """Conditional acceptance estimate for positions 0..k-1 (Laplace prior: 1/2 when unseen)."""
        tested, accepted = self.tested.get(key, []), self.accepted.get(key, [])
        return [(accepted[j] + 1) / (tested[j] + 2) if j < len(tested) else 0.5 for j in range(k)]

    def update(self, proposed: int, accepted: int, key: int = 0) -> None:
        """One verified chain: positions 0..min(accepted, proposed-1) were tested, 0..accepted-1 accepted."""
        tested, acc = self.tested.setdefault(key, []), self.accepted.setdefault(key, [])
        while len(tested) < proposed:
            tested.append(0.0)
            acc.append(0.0)
        for j in range(min(accepted + 1, proposed)):
            tested[j] = tested[j] * self.decay + 1
            acc[j] = acc[j] * self.decay + (j < accepted)

    def truncate(self, draft: Draft, key: int = 0) -> Draft:
        if draft.parents is not None or draft.size == 0:
            return draft
        if draft.confidences is not None:
            n = self.keep(draft.confidences.tolist())
        else:
            self.unconfident[key] = self.unconfident.get(key, 0) + 1
            explore = self.explore_every and self.unconfident[key] % self.explore_every == 0
            n = draft.size if explore else self.keep(self.measured(draft.size, key))
        self.kept.append(n)
        cut = lambda t: None if t is None else t[:n]  # noqa: E731
        return replace(draft, tokens=draft.tokens[:n], probs=cut(draft.probs), confidences=cut(draft.confidences))


def plan_groups(sizes: list[int], cost: VerifyCost) -> list[list[int]]:
    """Split requests (input lengths `sizes`) into forwards: each forward pads its members to its longest,
    costing cost(members * longest). Exact DP over the requests sorted by length -> lists of indices."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    n = len(order)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        longest = sizes[order[i - 1]]
        for j in range(i):
            c = best[j] + cost((i - j) * longest)
            if c < best[i]:
                best[i], cut[i] = c, j
    groups, i = [], n
    while i > 0:
        groups.append(order[cut[i]:i])
        i = cut[i]
    return groups[::-1]


class SourceSelector:
    """Routes each request, each round, to the source with the most emitted tokens per second
    (its drafting time + its share of verification time), exponentially weighted by rounds of the clock (a source's
    sums decay while others run); every source is tried `warmup` rounds first, and one not picked for
    `explore_every` rounds is tried again (a score only moves when its source runs: without retries, one slow spell
    would retire a source for good)."""

    def __init__(self, sources: list, warmup: int = 4, decay: float = 0.95, explore_every: int = 32):
        self.sources, self.warmup, self.decay, self.explore_every = list(sources), warmup, decay, explore_every
        self.tokens = [0.0] * len(self.sources)
        self.seconds = [0.0] * len(self.sources)
        self.rounds = [0] * len(self.sources)
        self.picks = [0] * len(self.sources)
        self.last_pick = [0] * len(self.sources)
        self.updated = [0] * len(self.sources)  # the clock when the sums were last decayed
        self.drafting = [0.0] * len(self.sources)  # this round's drafting seconds, until its verification
        self.clock = 0

    def score(self, i: int) -> float:
        return self.tokens[i] / max(self.seconds[i], 1e-9)

    def choose(self) -> int:
        self.clock += 1
        untried = [i for i, r in enumerate(self.rounds) if r < self.warmup]
        stale = [i for i, t in enumerate(self.last_pick) if self.clock - t > self.explore_every]
        i = (untried or stale or [max(range(len(self.sources)), key=self.score)])[0]
        self.picks[i] += 1
        self.last_pick[i] = self.clock
        return i

    def record_draft(self, i: int, seconds: float) -> None:
        self.drafting[i] += seconds

    def record_verify(self, i: int, emitted: int, seconds: float) -> None:
        kept = self.decay ** (self.clock - self.updated[i])
        self.tokens[i] = self.tokens[i] * kept + emitted
        self.seconds[i] = self.seconds[i] * kept + seconds + self.drafting[i]
        self.drafting[i], self.updated[i] = 0.0, self.clock
        self.rounds[i] += 1

    def report(self) -> list[dict]:
        return [{"source": getattr(s, "name", str(i)), "rounds": self.rounds[i], "picks": self.picks[i],
                 "tokens_per_s": round(self.score(i), 2)} for i, s in enumerate(self.sources)]
