"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the context's suffix.

No model, no features: try the last `max_ngram` tokens first, then shorter suffixes down to `min_ngram`;
the most recent earlier match wins (recent text predicts the next tokens best, and repetition loops are
recent). The copy is LZ77-style: when the continuation runs into the suffix itself it keeps copying the
tokens it has just produced, so a periodic context (a repetition loop) yields a full k-token draft
instead of stopping at the end of the context.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.sampling import SamplingConfig
from inference.sources.base import Draft, DraftContext


class PromptLookup:
    name = "prompt_lookup"
    needs_features = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                             f"max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def reset(self) -> None:
        pass  # stateless: everything it needs is in the context

    def find(self, tokens: Tensor) -> tuple[int, int] | None:
        """(start of the continuation, n-gram length) of the best match in tokens [T], or None."""
        T = tokens.numel()
        for n in range(min(self.max_ngram, T - 1), self.min_ngram - 1, -1):
            suffix = tokens[T - n :]  # [n]
            windows = tokens[: T - 1].unfold(0, n, 1)  # [T-n, n]: every n-gram that ends before the last token
            hits = (windows == suffix).all(-1).nonzero()
            if hits.numel():
                return int(hits[-1]) + n, n
        return None

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingConfig) -> Draft:
        tokens = ctx.tokens.cpu()
        match = self.find(tokens) if k > 0 else None
        if match is None:
            return Draft(tokens=torch.empty(0, dtype=torch.long))
        start, _ = match
        T = tokens.numel()
        period = T - start  # distance from the copy source to the end of the context
        idx = start + torch.arange(k) % period  # overlapping copy: position T+j reads T+j-period
        return Draft(tokens=tokens[idx].long())
