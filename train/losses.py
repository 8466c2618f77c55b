"""The ONE distillation loss module: draft q vs target p at a distillation temperature T (both softmaxes).

All functions return a per-row loss [N]; the caller weights rows (loss mask, position weights) and averages.
No T^2 rescaling: with an annealed T the gradient scale follows T, which the lr schedule absorbs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from inference.verify import acceptance_rates
from models.errors import DraftheadsError

LOSSES = ("fkl", "rkl", "tv", "lk")
LOSS_CHUNK_ROWS = 1024  # rows of [N, V] logits alive at once: 1024 x 49152 fp32 = 200 MB
KEEP_LOGITS_BYTES = 64 * 2**20  # a chunk's float32 logits up to this size are kept for backward, not recomputed


@dataclass(frozen=True)
class Teacher:
    """The target's side of a distillation loss at temperature T: computed once per chunk of rows, outside the
    checkpointed part of the step, so backward's recomputation redoes only the draft's softmax."""

    log_p: Tensor  # [N, V] log-softmax of target logits / T
    p: Tensor  # [N, V]
    temperature: float


def teacher(target_logits: Tensor | Teacher, temperature: float = 1.0) -> Teacher:
    if isinstance(target_logits, Teacher):
        return target_logits
    log_p = F.log_softmax(_scaled(target_logits, temperature), -1)
    return Teacher(log_p, log_p.exp(), temperature)


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    x = logits.float()
    return x if temperature == 1.0 else x / temperature


def forward_kl(target: Tensor | Teacher, draft_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(p || q) [N]: mass-covering, the usual distillation loss. `target`: logits or a Teacher."""
    t = teacher(target, temperature)
    return (t.p * (t.log_p - F.log_softmax(_scaled(draft_logits, t.temperature), -1))).sum(-1)


def reverse_kl(target: Tensor | Teacher, draft_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(q || p) [N]: mode-seeking."""
    t = teacher(target, temperature)
    log_q = F.log_softmax(_scaled(draft_logits, t.temperature), -1)
    return (log_q.exp() * (log_q - t.log_p)).sum(-1)


def total_variation(target: Tensor | Teacher, draft_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """TV(p, q) = 1 - sum_v min(p, q) [N] = the rejection probability of the lossless rule (1 - alpha)."""
    t = teacher(target, temperature)
    return 1.0 - acceptance_rates(t.p, F.softmax(_scaled(draft_logits, t.temperature), -1))


def distill_loss(kind: str, target: Tensor | Teacher, draft_logits: Tensor, temperature: float = 1.0,
                 tv_weight: float = 0.5) -> Tensor:
    """fkl | rkl | tv | lk ((1 - tv_weight) * KL + tv_weight * TV: KL's dense gradient early, TV = acceptance)."""
    t = teacher(target, temperature)
    if kind == "fkl":
        return forward_kl(t, draft_logits)
    if kind == "rkl":
        return reverse_kl(t, draft_logits)
    if kind == "tv":
        return total_variation(t, draft_logits)
    if kind == "lk":
        return (1 - tv_weight) * forward_kl(t, draft_logits) + tv_weight * total_variation(t, draft_logits)
    raise DraftheadsError(f"train.loss '{kind}' is not one of {list(LOSSES)}")


def token_ce(draft_logits: Tensor, labels: Tensor) -> Tensor:
    """CE [N] on the (regenerated) tokens; rows with label -1 (outside the draft vocab) give 0."""
    ce = F.cross_entropy(draft_logits.float(), labels.clamp(min=0), reduction="none")
    return ce * (labels >= 0)


def position_weights(depth: Tensor, weighting: str, gamma: float) -> Tensor:
    """[N] weight of a draft token at depth k (1-based): none -> 1, exp -> exp(-(k-1)/gamma)."""
    if weighting == "none":
        return torch.ones_like(depth, dtype=torch.float32)
    if weighting == "exp":
        return torch.exp(-(depth.float() - 1) / gamma)
    raise DraftheadsError(f"train.position_weighting '{weighting}' is not one of ['none', 'exp']")
