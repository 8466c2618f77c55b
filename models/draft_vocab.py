"""Reduced draft vocabulary: the N most frequent trained tokens, with the maps vLLM's EAGLE-3 loader reads.

d2t int64 [N]: target id = i + d2t[i];  t2d bool [V]: token is in the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.errors import DraftheadsError


@dataclass
class DraftVocab:
    draft_ids: Tensor  # [N] int64 target ids, ascending
    vocab_size: int  # V of the target

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def d2t(self) -> Tensor:  # [N] int64
        return self.draft_ids - torch.arange(self.size)

    @property
    def t2d(self) -> Tensor:  # [V] bool
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[self.draft_ids] = True
        return t2d


def build_draft_vocab(sequences, size: int, vocab_size: int) -> DraftVocab:
    """Top-`size` tokens by frequency over the loss tokens of `sequences` (dicts with input_ids, loss_mask).

    Ties and tokens never seen are filled by ascending id so the map is deterministic.
    """
    if not 0 < size <= vocab_size:
        raise DraftheadsError(f"draft.draft_vocab_size={size} must be in 1..{vocab_size} (the target vocabulary)")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        ids = seq["input_ids"].long()
        counts += torch.bincount(ids[seq["loss_mask"].bool()], minlength=vocab_size)[:vocab_size]
    # stable sort: equal counts keep ascending id order
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    ids = order.sort().values
    return DraftVocab(ids, vocab_size)
