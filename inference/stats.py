"""What a decoding run did: the one result type of the runtime, the reference loop, eval.acceptance and eval.speedup.

Counts are summed over requests and verification rounds, so `a += b` merges two runs (categories into an overall
row, repeats into a total). tau = emitted tokens / verification rounds (bonus token included, prefill excluded).
Depth j of a draft is *tested* in a round when every shallower drafted token on the accepted path was accepted
(a chain position, or a tree level), and *accepted* when the path goes through it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

COUNTS = ("requests", "rounds", "forwards", "emitted", "proposed", "prefill_s", "draft_s", "verify_s", "total_s")


@dataclass
class DecodeStats:
    k: int = 0  # the requested draft length: per-depth rows have at least k entries
    requests: int = 0
    rounds: int = 0  # verification rounds summed over requests (tau's denominator)
    forwards: int = 0  # target forwards (the runtime verifies several requests' rounds in one)
    emitted: int = 0
    proposed: int = 0  # draft tokens proposed, all rounds
    accept_hist: Counter = field(default_factory=Counter)  # drafted tokens accepted per round -> rounds
    tested: Counter = field(default_factory=Counter)  # depth j -> rounds where depth j was verified
    accepted: Counter = field(default_factory=Counter)  # depth j -> rounds where depth j was accepted
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    def record_round(self, proposed: int, accepted: int, depth: int) -> None:
        """One verified draft of `proposed` tokens, `depth` deep (= proposed for a chain), `accepted` of them kept."""
        self.rounds += 1
        self.proposed += proposed
        self.accept_hist[accepted] += 1
        for j in range(min(accepted + 1, depth)):
            self.tested[j] += 1
            self.accepted[j] += j < accepted

    @property
    def tau(self) -> float:
        return self.emitted / max(self.rounds, 1)

    def __iadd__(self, other: DecodeStats) -> DecodeStats:
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.k = max(self.k, other.k)
        for name in ("accept_hist", "tested", "accepted"):
            getattr(self, name).update(getattr(other, name))
        return self

    def __add__(self, other: DecodeStats) -> DecodeStats:  # sum(parts, DecodeStats())
        total = DecodeStats()
        total += self
        total += other
        return total

    def summary(self) -> dict:
        rounds = max(self.rounds, 1)
        depths = range(max([self.k] + [j + 1 for j in self.tested]))
        return {
            "requests": self.requests, "tokens": self.emitted, "rounds": self.rounds, "forwards": self.forwards,
            "tau": round(self.tau, 4), "mean_draft_len": round(self.proposed / rounds, 4),
            "acceptance": [round(self.accepted[j] / self.tested[j], 4) if self.tested[j] else None for j in depths],
            "tested": [self.tested[j] for j in depths],
            "accept_hist": {int(a): c for a, c in sorted(self.accept_hist.items())},
            "prefill_s": round(self.prefill_s, 4), "total_s": round(self.total_s, 4),
            "draft_ms_per_round": round(1000 * self.draft_s / rounds, 4),
            "verify_ms_per_round": round(1000 * self.verify_s / rounds, 4),
        }


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per request (prompt excluded), cut at max_new or after the first EOS
    stats: DecodeStats
