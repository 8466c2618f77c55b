"""A DSpark / DFlash head as a DraftSource: exact per-token probabilities and calibrated confidences.

Tokens are drawn LEFT TO RIGHT under the ONE SamplingConfig: row j's logits carry the Markov (or RNN) bias of the
token actually drafted at j-1, so `probs[j]` is exactly the q token j was sampled from (greedy: the argmax chain
through the bias). `confidences[j]` = c_j = P(token j survives | tokens < j accepted), what
inference/schedulers.py ConfidencePrefix multiplies into survival probabilities.

"head:DIR" builds this source when DIR holds a head of a family with confidences (models.families), and
inference/sources/draft_head.py's DraftHeadSource for every other family.
"""

from __future__ import annotations

import warnings

from inference.sources import draft_head, path_and_options
from models.checkpoint import read_metrics
from models.families import family


class DSparkSource(draft_head.DraftHeadSource):
    """DraftHeadSource's propose (tokens sampled left to right, each row's q reported) plus the confidence head.
    `calibrated_at`: the temperature train.calibration fitted the confidences at (None: not calibrated)."""

    calibrated_at: float | None = None

    def check_temperature(self, temperature: float) -> None:
        """Warn when the confidences were calibrated for another serving temperature than `temperature`: the
        prefix scheduler then keeps too many or too few drafts (speed only: the output is unchanged)."""
        if self.calibrated_at is not None and abs(self.calibrated_at - temperature) > 1e-6:
            warnings.warn(f"draft source '{self.name}': its confidences were calibrated at T={self.calibrated_at:g} "
                          f"and it serves at T={temperature:g}, so the confidence prefix scheduler cuts drafts on "
                          "the wrong survival rates (output unchanged, speed may drop); recalibrate with `python -m "
                          f"train.calibration --head DIR --features DIR --temperature {temperature:g}`", stacklevel=2)

    def _draft(self, tokens, feats, k: int, sample_fn):
        return self.head.draft(tokens, feats, self.cache, k, sample_fn)  # (logits [k, V_draft], confidences [k])


def head_source(arg: str | None, target):
    """Factory for 'head:DIR': the checkpoint's family decides the source class."""
    source = draft_head.head_source(arg, target)
    if not family(source.head.family_name).confidences:
        return source
    dspark = DSparkSource(source.head, source.name)
    dspark.calibrated_at = (read_metrics(path_and_options(arg)[0]).get("calibration") or {}).get("temperature")
    return dspark
