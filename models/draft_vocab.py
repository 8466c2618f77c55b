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


def to_draft_ids(t2d: Tensor, ids: Tensor, outside: int) -> Tensor:
    """Target ids [...] as draft-vocabulary indices (the position among t2d's True entries); `outside` where the
    token is not in the draft vocabulary."""
    index = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d[ids], index[ids], torch.full_like(ids, outside))


def build_draft_vocab(sequences, size: int, vocab_size: int) -> DraftVocab:
    """Top-`size` tokens by frequency over the loss tokens of `sequences` (dicts with input_ids, loss_mask).

    Ties and tokens never seen are filled by ascending id so the map is deterministic.
    """
    if not 0 < size <= vocab_size:
        raise DraftheadsError(f"draft.draft_vocab_size={size} must be in 1..{vocab_size} (the target vocabulary)")
    counts = token_counts(sequences, vocab_size)
    # stable sort: equal counts keep ascending id order
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    ids = order.sort().values
    return DraftVocab(ids, vocab_size)


def token_counts(sequences, vocab_size: int) -> Tensor:
    """[V] how often each token is a loss token of `sequences` (dicts with input_ids, loss_mask)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        ids = seq["input_ids"].long()
        counts += torch.bincount(ids[seq["loss_mask"].bool()], minlength=vocab_size)[:vocab_size]
    return counts


def extend_draft_vocab(head, target, counts: Tensor, n: int) -> int:
    """Add the `n` most frequent tokens of `counts` (a domain's) that the head's draft vocabulary lacks; their LM-head
    rows start as the target's. Heads with their own draft-vocab LM head (P-EAGLE, EAGLE-3, DSpark's backbone) and
    Medusa's shared one take it; returns how many tokens were added (0 when the vocabulary is the full one)."""
    from torch import nn

    if n <= 0 or getattr(head, "draft_ids", None) is None:
        return 0
    old = head.draft_ids.cpu()
    missing = counts.clone()
    missing[old] = -1  # already drafted
    new = torch.sort(missing, descending=True, stable=True).indices[:n]
    new = new[missing[new] > 0]
    if new.numel() == 0:
        return 0
    if getattr(head, "rank", 0):
        raise DraftheadsError("draft.vocab_extend does not resize DSpark's Markov head (its W1 / W2 are sized by the "
                              "draft vocabulary); rebuild the head or keep draft.vocab_extend=0")
    ids = torch.cat([old, new]).sort().values  # [N'] ascending, as d2t requires
    vocab = DraftVocab(ids, counts.numel())
    device = head.d2t.device
    if hasattr(head, "lm_head"):
        rows = target.model.get_output_embeddings().weight.detach()[ids].clone().to(head.lm_head.weight.dtype)
        keep = torch.isin(ids, old)
        rows[keep] = head.lm_head.weight.detach().cpu()[torch.searchsorted(old, ids[keep])].to(rows.dtype)
        head.lm_head = nn.Linear(rows.shape[1], ids.numel(), bias=False).to(device=device, dtype=rows.dtype)
        head.lm_head.weight.data.copy_(rows.to(device))
    head.d2t = vocab.d2t.to(device)
    head.t2d = vocab.t2d.to(device)
    head.config["draft_vocab_size"] = int(ids.numel())
    return int(new.numel())
