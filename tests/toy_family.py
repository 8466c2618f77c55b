"""A toy draft head family, the whole of what adding a family takes (tests/test_families.py registers it with one
line): depth d drafts from the target's newest final hidden state through its own linear map and the target's LM
head."""

import torch
from torch import nn

from models.layers import TrainableHead
from models.peagle import DraftTrainOutput


class ToyHead(TrainableHead):
    family_name = "toy"
    feature = "final_hidden"
    draft_ids = None

    def __init__(self, hidden_size: int, vocab_size: int, k: int):
        super().__init__()
        self.config = dict(hidden_size=hidden_size, vocab_size=vocab_size, k=k)
        self.k = k
        self.maps = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(k))
        for m in self.maps:  # start as the target's own next-token head
            nn.init.eye_(m.weight)
            nn.init.zeros_(m.bias)
        self._shared = {}

    def attach_target(self, target, draft_vocab=None, fresh: bool = False):
        self._shared["lm_head"] = target.model.get_output_embeddings()
        return self

    def full_vocab_logits(self, logits):
        return logits

    def _hidden(self, h, depth):
        return torch.stack([self.maps[int(d) - 1](x) for x, d in zip(h, depth)]) if len(h) else h

    def train_forward(self, batch, plan) -> DraftTrainOutput:
        keep = plan.valid & plan.trained
        b_idx = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)[keep]
        anchor, depth = plan.anchor[keep], plan.depth[keep]
        return DraftTrainOutput(self._hidden(batch["final_hidden"][b_idx, anchor], depth), b_idx, anchor, depth)

    def logits_for(self, hidden, depth):
        return self._shared["lm_head"](hidden)

    @torch.no_grad()
    def draft_logits(self, tokens, final_hidden, cache, k: int, sample_fn=None):
        depth = torch.arange(1, k + 1, device=final_hidden.device)
        return self.logits_for(self._hidden(final_hidden[-1:].expand(k, -1), depth), depth)


def build(target, k, num_layers, draft_vocab, parallel, share_lm_head):
    return ToyHead(target.hidden_size, target.vocab_size, k).to(target.dtype).attach_target(target)
