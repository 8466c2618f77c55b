"""`select:A+B+...`: each round, the source with the most emitted tokens per second so far.

The score of a source (inference.schedulers.SourceSelector) counts its drafting time and its share of the
verification forward, exponentially weighted, after `warmup` rounds each; so a draft file that costs microseconds
and a head that costs a forward compete on what they buy. The runtime reports every verified draft back through
`observe` (the one feedback hook a source may implement). Each draft carries the q of the part that sampled it, so
the verifier's rule stays exact. Parts that skip rounds catch up on their next call (caches only extend).
"""

from __future__ import annotations

import time
from dataclasses import replace

from inference.sampling import SamplingConfig
from inference.schedulers import SourceSelector
from inference.sources.base import Draft, DraftContext, DraftSource
from inference.sources.first import parts


class SelectSource:
    def __init__(self, sources: list[DraftSource], spec: str, warmup: int = 4):
        self.selector, self.name = SourceSelector(sources, warmup=warmup), spec
        self.needs_features = any(s.needs_features for s in sources)
        self.tree = any(getattr(s, "tree", False) for s in sources)

    @property
    def sources(self) -> list[DraftSource]:
        return self.selector.sources

    def reset(self) -> None:
        for s in self.sources:
            s.reset()

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingConfig) -> Draft:
        i = self.selector.choose()
        t0 = time.perf_counter()
        draft = self.sources[i].propose(ctx, k, sampling)
        self.selector.record_draft(i, time.perf_counter() - t0)
        return replace(draft, origin=i)

    def observe(self, draft: Draft, emitted: int, verify_seconds: float) -> None:
        """The runtime's report on a verified draft: tokens it emitted, its share of the forward's time."""
        if draft.origin is not None:
            self.selector.record_verify(draft.origin, emitted, verify_seconds)

    def report(self) -> list[dict]:
        return self.selector.report()


def select_source(arg: str | None, target) -> SelectSource:
    from inference.sources import build_source

    return SelectSource([build_source(spec, target) for spec in parts(arg, "select")], f"select:{arg}")
