"""COD sampling: which (anchor, depth) draft tokens a training step computes, so memory stays bounded.

Depth 1 (the anchor's own slot, which is also the context every deeper token attends to) keeps all n anchors.
Depth d >= 2 keeps ~ n * decay**(d-1) anchors (labelled ones first), each drawn from the anchors kept at depth d-1, so every kept token has its predecessor chain. decay = 0.7 bounds the total at ~ n / 0.3 tokens for
any K instead of n * K.

Columns are grouped by depth (block d holds depth d for every sequence, padded), so the chain's training-time
test can run depth by depth on contiguous columns.

Block drafters (DSpark / DFlash) train whole blocks instead: `anchor_plan` picks random anchors, every depth each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class CodPlan:
    anchor: Tensor  # [B, N] anchor t of each column (0 on padding)
    depth: Tensor  # [B, N] 1..K
    valid: Tensor  # [B, N] the token exists (inputs in range)
    trained: Tensor  # [B, N] it has a label: token anchor+depth+1 exists and is a loss token
    predecessor: Tensor  # [B, N] column of (same anchor, depth-1); -1 for depth 1
    blocks: list[int]  # column where each depth's block starts, plus the end

    def depth_columns(self, d: int) -> Tensor:
        """Columns of depth d: none past the plan's deepest depth (short sequences end the plan early)."""
        end = self.blocks[min(d, len(self.blocks) - 1)]
        return torch.arange(self.blocks[min(d - 1, len(self.blocks) - 1)], end, device=self.anchor.device)

    def columns_up_to(self, d: int) -> Tensor:
        return torch.arange(0, self.blocks[min(d, len(self.blocks) - 1)], device=self.anchor.device)


def plan_to(plan: CodPlan, device) -> CodPlan:
    """The plan's tensors on `device` (plans are built on the CPU)."""
    return CodPlan(**{f: (v.to(device) if isinstance(v, Tensor) else v) for f, v in vars(plan).items()})


def cod_plan(loss_mask: Tensor, lengths: Tensor, k: int, decay: float, generator: torch.Generator | None = None) -> CodPlan:
    """loss_mask [B, T] bool (token i is trained), lengths [B] -> the plan. decay = 1 keeps everything."""
    B, T = loss_mask.shape
    t = torch.arange(T)
    anchors = [t.clone() for _ in range(B)]  # depth 1: all positions (validity below)

    def has_label(b: int, a: Tensor, d: int) -> Tensor:
        target = a + d + 1
        ok = target < lengths[b]
        return ok & loss_mask[b, target.clamp(max=T - 1)]

    n = [int(min(max(int(lengths[b]) - 1, 0), T)) for b in range(B)]  # depth-1 tokens (anchor t reads x_{t+1})
    per_depth = [anchors]
    for d in range(2, k + 1):
        kept = []
        for b in range(B):
            cand = per_depth[-1][b]
            cand = cand[cand + d + 1 < lengths[b]]  # the token after it exists (its label position)
            want = min(cand.numel(), round(n[b] * decay ** (d - 1)))
            # labelled tokens first (a loss-masked label would be wasted compute), random among equals
            priority = (~has_label(b, cand, d)).float() + torch.rand(cand.numel(), generator=generator)
            kept.append(cand[priority.argsort()[:want]].sort().values)
        per_depth.append(kept)

    cols_anchor, cols_depth, cols_valid, cols_trained, cols_pred, blocks = [], [], [], [], [], [0]
    for d, kept in enumerate(per_depth, start=1):
        width = max(x.numel() for x in kept)
        if width == 0:
            break
        a = torch.zeros(B, width, dtype=torch.long)
        v = torch.zeros(B, width, dtype=torch.bool)
        for b, x in enumerate(kept):
            a[b, : x.numel()] = x
            v[b, : x.numel()] = (x + d) < lengths[b] if d == 1 else True  # depth 1 reads token a+1
        tr = torch.stack([has_label(b, a[b], d) for b in range(B)]) & v
        if d == 1:
            pred = torch.full((B, width), -1, dtype=torch.long)
        else:  # column of the same anchor in block d-1 (kept sets are sorted, so searchsorted finds it)
            prev_a, prev_start = cols_anchor[-1], blocks[-2]
            prev_width = prev_a.shape[1]
            prev_key = torch.where(cols_valid[-1], prev_a, torch.full_like(prev_a, T + 1))
            pred = torch.searchsorted(prev_key, a).clamp(max=prev_width - 1) + prev_start
        cols_anchor.append(a)
        cols_depth.append(torch.full((B, width), d, dtype=torch.long))
        cols_valid.append(v)
        cols_trained.append(tr)
        cols_pred.append(pred)
        blocks.append(blocks[-1] + width)
    return CodPlan(torch.cat(cols_anchor, 1), torch.cat(cols_depth, 1), torch.cat(cols_valid, 1),
                   torch.cat(cols_trained, 1), torch.cat(cols_pred, 1), blocks)


def anchor_plan(loss_mask: Tensor, lengths: Tensor, k: int, anchors: int, generator: torch.Generator | None = None,
                full_blocks: bool = False) -> CodPlan:
    """Up to `anchors` random anchors per sequence, whole blocks: columns (a, 1..k) per anchor, in that order.

    An anchor a qualifies when its first draft token x_{a+2} is a loss token (full_blocks: all of x_{a+2..a+k+1});
    slot d is trained when x_{a+d+1} exists and is a loss token. loss_mask [B, T] bool, lengths [B].
    """
    B, T = loss_mask.shape
    idx = torch.arange(T)
    rows_a = []
    for b in range(B):
        L = int(lengths[b])
        need = idx[:, None] + 2 + (torch.arange(k) if full_blocks else torch.zeros(1, dtype=torch.long))
        ok = (need < L).all(1) & loss_mask[b][need.clamp(max=T - 1)].all(1)
        cand = ok.nonzero().squeeze(1)
        pick = cand[torch.randperm(cand.numel(), generator=generator)[:anchors]].sort().values
        rows_a.append(pick)
    A = max(1, max(r.numel() for r in rows_a))
    anchor = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    for b, r in enumerate(rows_a):
        anchor[b, : r.numel()], valid[b, : r.numel()] = r, True
    anchor = anchor.repeat_interleave(k, 1)  # [B, A*k]
    depth = torch.arange(1, k + 1).repeat(A).expand(B, -1).clone()
    valid = valid.repeat_interleave(k, 1)
    label = (anchor + depth + 1).clamp(max=T - 1)
    trained = valid & (anchor + depth + 1 < lengths[:, None]) & loss_mask.gather(1, label)
    return CodPlan(anchor, depth, valid, trained, torch.full_like(anchor, -1), [0, A * k])
