"""The ONE distillation loss module: draft q vs target p at a distillation temperature T (both softmaxes).

All functions return a per-row loss [N]; the caller weights rows (loss mask, position weights) and averages.
No T^2 rescaling: with an annealed T the gradient scale follows T, which the lr schedule absorbs.
"""

from __future__ import annotations

from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor

from inference.verify import acceptance_rates
from models.errors import DraftheadsError

LOSSES = ("fkl", "rkl", "tv", "lk")
LOSS_CHUNK_ROWS = 1024  # rows of [N, V] logits alive at once: 1024 x 49152 fp32 = 200 MB
KEEP_LOGITS_BYTES = 64 * 2**20  # a chunk's float32 logits up to this size are kept for backward, not recomputed


class Softmax:
    """One side of a distillation loss: log-softmax of logits / T, and its exp on first use. Built once and passed to
    every term that needs it: the target's once per chunk of rows, outside the checkpointed part of the step; the
    draft's once per forward, shared by the distillation term, the token CE (at T = 1) and the confidence target."""

    def __init__(self, logits: Tensor, temperature: float = 1.0):
        self.logits, self.temperature = logits, temperature
        # at T = 1 the float32 cast happens inside the kernel (no bf16 -> fp32 copy)
        self.log_p = F.log_softmax(logits, -1, dtype=torch.float32) if temperature == 1.0 else \
            F.log_softmax(logits.float() / temperature, -1)

    @cached_property
    def p(self) -> Tensor:
        return self.log_p.exp()

    def take(self, index: Tensor) -> "Softmax":
        """Rows `index` of this softmax (rows that share a distribution: computed once, then gathered)."""
        return _SoftmaxRows(self, index)


class _SoftmaxRows(Softmax):
    """Softmax.take: the whole's log_p at the rows `index`, its exp taken after the gather (so the whole's log_p is
    freed at once and a chunk holds no more than the per-row softmax did); the logits gathered only if a term asks
    for them (a term at another temperature)."""

    def __init__(self, whole: Softmax, index: Tensor):
        self.temperature, self._whole_logits, self._index = whole.temperature, whole.logits, index
        self.log_p = whole.log_p[index]

    @cached_property
    def logits(self) -> Tensor:
        return self._whole_logits[self._index]


def softmax_of(x: Tensor | Softmax, temperature: float | None = None) -> Softmax:
    """x as a Softmax at `temperature` (None: a Softmax as built, logits at T = 1); rebuilt only if T differs."""
    if isinstance(x, Softmax):
        return x if temperature in (None, x.temperature) else Softmax(x.logits, temperature)
    return Softmax(x, 1.0 if temperature is None else temperature)


def forward_kl(target: Tensor | Softmax, draft: Tensor | Softmax, temperature: float | None = None) -> Tensor:
    """KL(p || q) [N]: mass-covering, the usual distillation loss. Each side: logits, or a Softmax."""
    p, q = softmax_of(target, temperature), softmax_of(draft, temperature)
    return (p.p * (p.log_p - q.log_p)).sum(-1)


def reverse_kl(target: Tensor | Softmax, draft: Tensor | Softmax, temperature: float | None = None) -> Tensor:
    """KL(q || p) [N]: mode-seeking."""
    p, q = softmax_of(target, temperature), softmax_of(draft, temperature)
    return (q.p * (q.log_p - p.log_p)).sum(-1)


def total_variation(target: Tensor | Softmax, draft: Tensor | Softmax, temperature: float | None = None) -> Tensor:
    """TV(p, q) = 1 - sum_v min(p, q) [N] = the rejection probability of the lossless rule (1 - alpha)."""
    return 1.0 - acceptance_rates(softmax_of(target, temperature).p, softmax_of(draft, temperature).p)


def distill_loss(kind: str, target: Tensor | Softmax, draft: Tensor | Softmax, temperature: float | None = None,
                 tv_weight: float = 0.5) -> Tensor:
    """fkl | rkl | tv | lk ((1 - tv_weight) * KL + tv_weight * TV: KL's dense gradient early, TV = acceptance)."""
    p, q = softmax_of(target, temperature), softmax_of(draft, temperature)
    if kind == "fkl":
        return forward_kl(p, q)
    if kind == "rkl":
        return reverse_kl(p, q)
    if kind == "tv":
        return total_variation(p, q)
    if kind == "lk":
        return (1 - tv_weight) * forward_kl(p, q) + tv_weight * total_variation(p, q)
    raise DraftheadsError(f"train.loss '{kind}' is not one of {list(LOSSES)}")


def token_ce(draft: Tensor | Softmax, labels: Tensor) -> Tensor:
    """CE [N] on the (regenerated) tokens at T = 1; rows with label -1 (outside the draft vocab) give 0."""
    log_q = softmax_of(draft, 1.0).log_p
    return -log_q.gather(-1, labels.clamp(min=0)[:, None])[:, 0] * (labels >= 0)


def position_weights(depth: Tensor, weighting: str, gamma: float) -> Tensor:
    """[N] weight of a draft token at depth k (1-based): none -> 1, exp -> exp(-(k-1)/gamma)."""
    if weighting == "none":
        return torch.ones_like(depth, dtype=torch.float32)
    if weighting == "exp":
        return torch.exp(-(depth.float() - 1) / gamma)
    raise DraftheadsError(f"train.position_weighting '{weighting}' is not one of ['none', 'exp']")
