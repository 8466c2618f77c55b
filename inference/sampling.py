"""The ONE sampling config shared by drafting and verification, and the distribution it defines."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def greedy_tokens(logits: Tensor) -> Tensor:
    """argmax over the last dimension, the first index on ties. Through max(): torch's CPU argmax has no vectorised
    bfloat16 kernel (several times slower on [B, V] logits); max() returns the same first index."""
    return logits.max(-1).indices


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    def __post_init__(self):
        from models.errors import DraftheadsError

        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise DraftheadsError(f"temperature {self.temperature} must be a finite number >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise DraftheadsError(f"top_p {self.top_p} must be in (0, 1] (1 = off)")
        if self.top_k < 0:
            raise DraftheadsError(f"top_k {self.top_k} must be >= 0 (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: Tensor) -> Tensor:
        """Distribution [..., V] this config samples from; one-hot argmax when greedy."""
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).to(logits.dtype)
        logits = logits / self.temperature
        if self.top_k > 0 and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
            drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= self.top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(-1)

    def sample(self, logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Token ids [...] drawn from probs(logits)."""
        if self.greedy:
            return greedy_tokens(logits)
        p = self.probs(logits)
        flat = p.reshape(-1, p.shape[-1])
        return torch.multinomial(flat, 1, generator=generator).reshape(p.shape[:-1])
