"""The `DraftSource` protocol: anything that proposes draft tokens for the verifier.

A source sees the committed context (token ids, and the target's captured hidden states for every
committed token except the newest, which the target has not processed yet) and returns a `Draft`.
P-EAGLE heads, DSpark heads, draft files and prompt lookup all implement it; verification never
needs to know which one it is talking to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor

from inference.sampling import SamplingConfig


@dataclass
class DraftContext:
    tokens: Tensor  # [T] int64, committed tokens (prompt + accepted output)
    aux_hidden: Tensor | None = None  # [T-1, n_layers*H]: target features of tokens[:-1] (None if not captured)
    final_hidden: Tensor | None = None  # [T-1, H]: LM-head input of tokens[:-1]


@dataclass
class Draft:
    tokens: Tensor  # [k] int64 draft tokens, k <= requested (0 means "nothing to propose")
    probs: Tensor | None = None  # [k, V] draft distributions q_k they were sampled from; None = point mass
    confidences: Tensor | None = None  # [k] P(token k accepted | previous accepted), when the source knows
    parents: Tensor | None = None  # [k] tree parent index per token (-1 = anchor); None = a chain
    origin: int | None = None  # which part of a combined source (select:) proposed it; truncation keeps it

    @property
    def size(self) -> int:
        return int(self.tokens.numel())


@runtime_checkable
class DraftSource(Protocol):
    name: str
    needs_features: bool  # True if propose() reads ctx.aux_hidden / ctx.final_hidden

    def reset(self) -> None:
        """Forget per-request state (called before each new prompt). A source that samples its drafts also has
        `seed_draws(seed)`: `reset_source` passes it the run's seed (through a combined source's `sources`), so the
        draws follow the run, not the source's history."""

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingConfig) -> Draft:
        """Up to k draft tokens continuing ctx.tokens, sampled under `sampling` (greedy if temperature 0)."""


def reset_source(source, seed: int) -> None:
    """Before a run: the source forgets per-request state and, where it samples, draws from the run's seed (the
    runtime mixes in the request's index for per-request sources: requests of one batch draw independently)."""
    source.reset()
    _seed_draws(source, seed)


def _seed_draws(source, seed: int) -> None:
    if hasattr(source, "seed_draws"):
        source.seed_draws(seed)
    for member in getattr(source, "sources", ()):  # first: / select: sources
        _seed_draws(member, seed)


def mix_seeds(*seeds: int) -> int:
    """One 63-bit seed from several (order matters): distinct inputs give unrelated generator streams."""
    out = 0
    for s in seeds:
        out = (out * 0x9E3779B97F4A7C15 + s + 1) % (1 << 63)
    return out
