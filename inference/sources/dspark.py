"""A DSpark / DFlash head as a DraftSource: exact per-token probabilities and calibrated confidences.

Tokens are drawn LEFT TO RIGHT under the ONE SamplingConfig: row j's logits carry the Markov (or RNN) bias of the
token actually drafted at j-1, so `probs[j]` is exactly the q token j was sampled from (greedy: the argmax chain
through the bias). `confidences[j]` = c_j = P(token j survives | tokens < j accepted), what
inference/schedulers.py ConfidencePrefix multiplies into survival probabilities.

"head:DIR" builds this source when DIR holds a dspark / dflash checkpoint (family dispatch in `head_source`), and
inference/sources/draft_head.py's DraftHeadSource for every other family.
"""

from __future__ import annotations

import torch

from inference.sampling import SamplingConfig
from inference.sources import draft_head
from inference.sources.base import Draft, DraftContext
from models.dspark import DSparkDrafter
from models.errors import DraftheadsError


class DSparkSource(draft_head.DraftHeadSource):
    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int, sampling: SamplingConfig) -> Draft:
        if ctx.aux_hidden is None:
            raise DraftheadsError(f"draft source '{self.name}' needs the target's aux_hidden for the context; "
                                  "run it through the runtime with feature capture (sources with needs_features=True)")
        k = min(k, self.head.k)
        if k <= 0 or ctx.tokens.numel() < 2:
            return Draft(ctx.tokens.new_zeros(0))
        drafted = []

        def sample_fn(draft_logits):  # tokens 1..k-1: each one biases the next row
            drafted.append(sampling.sample(self.head.full_vocab_logits(draft_logits.float())[None], self.generator)[0])
            return drafted[-1]

        logits, confidences = self.head.draft(ctx.tokens, ctx.aux_hidden, self.cache, k, sample_fn)
        logits = self.head.full_vocab_logits(logits.float())  # [k, V]
        last = sampling.sample(logits[-1:], self.generator)
        tokens = torch.cat([torch.stack(drafted), last]) if drafted else last
        probs = None if sampling.greedy else sampling.probs(logits)
        return Draft(tokens.long(), probs, confidences.float())


def head_source(arg: str | None, target):
    """Factory for 'head:DIR': the checkpoint's family decides the source class."""
    source = draft_head.head_source(arg, target)
    if isinstance(source.head, DSparkDrafter):
        return DSparkSource(source.head, source.name)
    return source
