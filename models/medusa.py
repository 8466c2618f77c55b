"""Medusa baseline: K independent heads on the target's final hidden state (LM-head input).

Head k (1-based) at anchor t reads final_hidden[t] (the target already predicts x_{t+1} from it) and predicts
x_{t+k+1}: the same (anchor, depth) -> label mapping as P-EAGLE, so the trainer and COD plan are shared.
Each head = ResBlock (x + SiLU(W x), W zero-initialised so a fresh head equals the target's next-token head)
+ a linear vocabulary projection (the target's frozen LM head when shared, else its own copy). With a draft
vocabulary the shared projection is the frozen LM head's rows of those tokens (d2t / t2d maps as P-EAGLE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.errors import DraftheadsError
from models.layers import TrainableHead
from models.peagle import DraftTrainOutput, PEagleDrafter


class ResBlock(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(TrainableHead):
    family = "medusa"
    feature = "final_hidden"

    def __init__(self, hidden_size: int, vocab_size: int, k: int, num_layers: int = 1, share_lm_head: bool = True,
                 draft_vocab_size: int | None = None):
        super().__init__()
        self.config = dict(hidden_size=hidden_size, vocab_size=vocab_size, k=k, num_layers=num_layers,
                           share_lm_head=share_lm_head, draft_vocab_size=draft_vocab_size)
        if draft_vocab_size is not None and draft_vocab_size < vocab_size:
            if not share_lm_head:
                raise DraftheadsError("draft.family=medusa with draft.draft_vocab_size needs draft.share_lm_head=true")
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
        self.k, self.vocab_size, self.share_lm_head = k, vocab_size, share_lm_head
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(k))
        if not share_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(k))
        self._shared: dict[str, nn.Module] = {}

    @property
    def family_name(self) -> str:
        return "medusa"

    def attach_target(self, target, draft_vocab=None, fresh: bool = False) -> "MedusaHeads":
        head = target.model.get_output_embeddings()
        self._shared["lm_head"] = head
        if fresh and draft_vocab is not None and hasattr(self, "d2t"):
            self.d2t.copy_(draft_vocab.d2t)
            self.t2d.copy_(draft_vocab.t2d)
        if fresh and not self.share_lm_head:
            with torch.no_grad():
                for lm in self.lm_heads:
                    lm.weight.copy_(head.weight)
        return self

    def _per_depth(self, h: Tensor, depth: Tensor, fn, width: int) -> Tensor:
        out = h.new_zeros(h.shape[0], width)
        for d in range(1, self.k + 1):  # every depth, rows or none: the same module calls on every rank (ZeRO-3)
            rows = (depth == d).nonzero().squeeze(1)
            out = out.index_copy(0, rows, fn(d, h[rows]))
        return out

    def logits_for(self, hidden: Tensor, depth: Tensor) -> Tensor:
        """hidden [N, H] (after the head's ResBlocks), depth [N] (1..K) -> logits [N, V_draft]."""
        if self.share_lm_head:
            lm = self._shared["lm_head"]
            hidden = hidden.to(lm.weight.dtype)  # the target's dtype may not be the head's
            if not hasattr(self, "d2t"):
                return lm(hidden)
            ids = self.draft_ids
            return F.linear(hidden, lm.weight[ids], None if lm.bias is None else lm.bias[ids])
        return self._per_depth(hidden, depth, lambda d, x: self.lm_heads[d - 1](x), self.vocab_size)

    def head_logits(self, h: Tensor, depth: Tensor) -> Tensor:
        """final hidden h [N, H], depth [N] (1..K) -> logits [N, V]."""
        blocks = self._per_depth(h, depth, lambda d, x: self.blocks[d - 1](x), h.shape[-1])
        return self.logits_for(blocks, depth)

    full_vocab_logits = PEagleDrafter.full_vocab_logits  # draft-vocab logits -> [.., V] (-inf outside)
    draft_ids = PEagleDrafter.draft_ids

    def train_forward(self, batch: dict, plan) -> DraftTrainOutput:
        keep = plan.valid & plan.trained
        B = keep.shape[0]
        b_idx = torch.arange(B, device=keep.device)[:, None].expand_as(keep)[keep]
        anchor, depth = plan.anchor[keep], plan.depth[keep]
        h = batch["final_hidden"][b_idx, anchor]  # [N, H]
        hidden = self._per_depth(h, depth, lambda d, x: self.blocks[d - 1](x), h.shape[-1])
        return DraftTrainOutput(hidden, b_idx, anchor, depth)


    @torch.no_grad()
    def draft_logits(self, tokens: Tensor, final_hidden: Tensor, cache, k: int, sample_fn=None) -> Tensor:
        """[k, V]: head d on the newest committed feature row (anchor T-2). One pass, no cache needed."""
        h = final_hidden[-1:].to(self.blocks[0][0].linear.weight.dtype).expand(k, -1)
        return self.head_logits(h, torch.arange(1, k + 1, device=h.device))


def medusa_for_target(target, k: int, num_layers: int = 1, share_lm_head: bool = True, draft_vocab=None) -> MedusaHeads:
    heads = MedusaHeads(target.hidden_size, target.vocab_size, k, num_layers, share_lm_head,
                        None if draft_vocab is None else draft_vocab.size)
    return heads.to(target.dtype).attach_target(target, draft_vocab, fresh=True)
