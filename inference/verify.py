"""The ONE verifier: decide how much of a chain draft the target accepts, and the token that follows.

Greedy (temperature 0): accept while draft token == target argmax; the next token is the argmax at
the first mismatch (or the bonus position). The output is bit-identical to plain greedy decoding.

Sampling (temperature > 0), the lossless rule of Leviathan et al. / Chen et al.: accept draft token x_j
with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection emit a token from
norm(max(0, p_j - q_j)); if all k are accepted, emit a bonus token from p_{k+1}. The emitted sequence
then has exactly the target's distribution whatever q is. p = sampling.probs(target logits) and q is
the draft's distribution (a point mass on the draft token when the source gave no probs), so draft and
verify read the same SamplingConfig.

Each rule is one function over [k]-shaped tensors with no Python loop over positions, so a batched
runtime can call the same code with a leading batch dim later.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.sampling import SamplingConfig, greedy_tokens
from inference.sources.base import Draft


def point_mass(tokens: Tensor, vocab_size: int) -> Tensor:
    """q [k, V] for a source without probabilities: all mass on the proposed token."""
    return torch.nn.functional.one_hot(tokens, vocab_size).float()


def first_rejection(accepted: Tensor) -> int:
    """Number of leading True values in accepted [k] (= accepted length of a chain)."""
    return int(accepted.long().cumprod(0).sum())


def accepts(u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    """The lossless rule's test, elementwise: accept x with probability min(1, p(x)/q(x)) given uniforms u, written
    u * q(x) < p(x) (no division: p >= q always accepts, p = q = 0 never does). The verifier, the tree, the batched
    kernels' reference and the RL stage all use this one test."""
    return u * q_x < p_x


def accept_greedy(draft_tokens: Tensor, target_logits: Tensor) -> tuple[int, int]:
    """draft_tokens [k], target_logits [k+1, V] -> (n_accepted, next_token)."""
    target_tokens = greedy_tokens(target_logits)  # [k+1]
    k = draft_tokens.numel()
    n = first_rejection(draft_tokens == target_tokens[:k])
    return n, int(target_tokens[n])


def accept_rejection(
    draft_tokens: Tensor,  # [k]
    p: Tensor,  # [k+1, V] target distributions (position k is the bonus distribution)
    q: Tensor,  # [k, V] draft distributions the draft tokens were sampled from
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """The lossless rejection rule -> (n_accepted, next_token)."""
    k = draft_tokens.numel()
    idx = draft_tokens[:, None]
    p_x = p[:k].gather(-1, idx).squeeze(-1)  # [k]
    q_x = q.gather(-1, idx).squeeze(-1)  # [k]
    u = torch.rand(k, generator=generator, device=p.device)  # [k]
    n = first_rejection(accepts(u, p_x, q_x))
    if n == k:
        next_dist = p[k]  # bonus token
    else:
        residual = (p[n] - q[n]).clamp_min(0)  # [V]
        # a rejection implies q_x > p_x somewhere, so the residual has mass; guard float round-off anyway
        next_dist = residual if residual.sum() > 0 else p[n]
    next_token = torch.multinomial(next_dist, 1, generator=generator)
    return n, int(next_token)


def acceptance_rates(p: Tensor, q: Tensor) -> Tensor:
    """alpha [...] = sum_v min(p, q): P(a token drawn from q is accepted | the earlier ones were) under the rejection
    rule, for target and draft distributions p, q [..., V] of the same shape: the RL stage's per-depth rate (train/rl.py
    expected_accepted), the calibration's label, 1 - the TV loss."""
    return torch.minimum(p, q).sum(-1)


def verify_chain(
    draft: Draft,
    target_logits: Tensor,  # [k+1, V]: target logits at [anchor, d1..dk]; row j predicts position j+1
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Verify a chain draft -> (n_accepted in 0..k, next_token). The round emits d1..dn then next_token.

    Per-position outcome: positions 0..min(n, k-1) were tested (a position is tested only when all
    earlier ones were accepted) and positions 0..n-1 accepted (inference.stats.DecodeStats.record_round).
    """
    k = draft.size
    if draft.parents is not None:
        raise ValueError("verify_chain got a tree draft (parents set); tree verification is a separate routine")
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for a draft of {k}; expected k+1")
    tokens = draft.tokens.to(target_logits.device)
    if sampling.greedy:
        return accept_greedy(tokens, target_logits)
    p = sampling.probs(target_logits)  # [k+1, V]
    q = draft.probs.to(p) if draft.probs is not None else point_mass(tokens, p.shape[-1]).to(p)  # [k, V]
    return accept_rejection(tokens, p, q, generator)
