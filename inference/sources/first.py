"""`first:A+B+...`: each round, the draft of the first source that proposes anything.

Prompt lookup drafts for free and wins on text that repeats its context (greedy SmolLM2 on MT-bench: τ 1.55 against
a P-EAGLE head's 1.32); a head wins where nothing repeats (T=1: 1.28 against 1.14). `first:prompt_lookup+head:DIR`
asks the lookup first and the head only when the lookup finds no match. Each draft carries the q of the source that
sampled it, so the verifier's rule stays exact. A head skipped for some rounds catches up on its next call (its
cache only extends over the grown context).
"""

from __future__ import annotations

from inference.sampling import SamplingConfig
from inference.sources.base import Draft, DraftContext, DraftSource
from models.errors import DraftheadsError


class FirstSource:
    def __init__(self, sources: list[DraftSource], spec: str):
        self.sources, self.name = sources, spec
        self.needs_features = any(s.needs_features for s in sources)
        self.tree = any(getattr(s, "tree", False) for s in sources)  # some rounds are token trees: the tree runtime

    def reset(self) -> None:
        for s in self.sources:
            s.reset()

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingConfig) -> Draft:
        draft = None
        for source in self.sources:
            draft = source.propose(ctx, k, sampling)
            if draft.size:
                return draft
        return draft


def parts(arg: str | None, name: str = "first") -> list[str]:
    """The part specs of a combining source (first:, select:): two or more joined by '+'."""
    specs = [p for p in (arg or "").split("+") if p]
    if len(specs) < 2:
        raise DraftheadsError(f"draft source '{name}:{arg}' needs two or more sources joined by '+', "
                              f"e.g. {name}:prompt_lookup+head:outputs/run/head")
    return specs


def first_source(arg: str | None, target) -> FirstSource:
    from inference.sources import build_source

    return FirstSource([build_source(spec, target) for spec in parts(arg)], f"first:{arg}")
