"""The ONE distillation loss module: draft q vs target p at a distillation temperature T (both softmaxes).

All functions return a per-row loss [N]; the caller weights rows (loss mask, position weights) and averages.
No T^2 rescaling: with an annealed T the gradient scale follows T, which the lr schedule absorbs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from inference.verify import acceptance_rates
from models.errors import DraftheadsError

LOSSES = ("fkl", "rkl", "tv", "lk")


def forward_kl(target_logits: Tensor, draft_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(p || q) [N]: mass-covering, the usual distillation loss."""
    log_p = F.log_softmax(target_logits.float() / temperature, -1)
    log_q = F.log_softmax(draft_logits.float() / temperature, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def reverse_kl(target_logits: Tensor, draft_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(q || p) [N]: mode-seeking."""
    return forward_kl(draft_logits, target_logits, temperature)


def total_variation(target_logits: Tensor, draft_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """TV(p, q) = 1 - sum_v min(p, q) [N] = the rejection probability of the lossless rule (1 - alpha)."""
    p = F.softmax(target_logits.float() / temperature, -1)
    q = F.softmax(draft_logits.float() / temperature, -1)
    return 1.0 - acceptance_rates(p, q)


def distill_loss(kind: str, target_logits: Tensor, draft_logits: Tensor, temperature: float = 1.0,
                 tv_weight: float = 0.5) -> Tensor:
    """fkl | rkl | tv | lk ((1 - tv_weight) * KL + tv_weight * TV: KL's dense gradient early, TV = acceptance)."""
    if kind == "fkl":
        return forward_kl(target_logits, draft_logits, temperature)
    if kind == "rkl":
        return reverse_kl(target_logits, draft_logits, temperature)
    if kind == "tv":
        return total_variation(target_logits, draft_logits, temperature)
    if kind == "lk":
        return ((1 - tv_weight) * forward_kl(target_logits, draft_logits, temperature)
                + tv_weight * total_variation(target_logits, draft_logits, temperature))
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
