"""A DSpark / DFlash head as a DraftSource: exact per-token probabilities and calibrated confidences.

Tokens are drawn LEFT TO RIGHT under the ONE SamplingConfig: row j's logits carry the Markov (or RNN) bias of the
token actually drafted at j-1, so `probs[j]` is exactly the q token j was sampled from (greedy: the argmax chain
through the bias). `confidences[j]` = c_j = P(token j survives | tokens < j accepted), what
inference/schedulers.py ConfidencePrefix multiplies into survival probabilities.

"head:DIR" builds this source when DIR holds a head of a family with confidences (models.families), and
inference/sources/draft_head.py's DraftHeadSource for every other family.
"""

from __future__ import annotations

from inference.sources import draft_head
from models.families import family


class DSparkSource(draft_head.DraftHeadSource):
    """DraftHeadSource's propose (tokens sampled left to right, each row's q reported) plus the confidence head."""

    def _draft(self, tokens, feats, k: int, sample_fn):
        return self.head.draft(tokens, feats, self.cache, k, sample_fn)  # (logits [k, V_draft], confidences [k])


def head_source(arg: str | None, target):
    """Factory for 'head:DIR': the checkpoint's family decides the source class."""
    source = draft_head.head_source(arg, target)
    if family(source.head.family_name).confidences:
        return DSparkSource(source.head, source.name)
    return source
