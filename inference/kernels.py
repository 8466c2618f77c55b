"""Fused Triton kernels for batched acceptance and tree masks, each next to the PyTorch reference it must equal.

Why: on a GPU the per-request acceptance loop costs one device->host sync per request per round, and an
argmax over [B, K+1, V] followed by compare/cumprod is 4 launches; one kernel per batch does it with one sync.
Tree masks for big trees (a Python walk per node) move to the device the same way. On CPU the references run;
the kernels are tested on CPU under Triton's interpreter (TRITON_INTERPRET=1) when triton is installed.

    accept_greedy_batched(draft [B,K], lens [B], logits [B,K+1,V])         -> n_accepted [B], next_token [B]
    accept_rejection_batched(draft, lens, p [B,K+1,V], q [B,K,V]|None, u [B,K]) -> n_accepted [B]
    tree_masks(parents [B,N])                                                -> [B, N+1, N+1] bool
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from inference.tree import tree_mask
from inference.verify import accept_greedy, accepts, first_rejection

try:  # triton ships with CUDA builds of torch; the CPU wheel has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def triton_usable(t: Tensor) -> bool:
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# ---------------------------------------------------------------------------------------------
# references (built on inference/verify.py and inference/tree.py: the one verifier, the one mask)
# ---------------------------------------------------------------------------------------------
def accept_greedy_reference(draft: Tensor, lens: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
    out = [accept_greedy(draft[b, : int(lens[b])], logits[b, : int(lens[b]) + 1]) for b in range(draft.shape[0])]
    return torch.tensor([n for n, _ in out]), torch.tensor([t for _, t in out])


def accept_rejection_reference(draft: Tensor, lens: Tensor, p: Tensor, q: Tensor | None, u: Tensor) -> Tensor:
    """The accept test of verify.accept_rejection (u * q(x) < p(x), first failure) with given uniforms."""
    n = []
    for b in range(draft.shape[0]):
        k = int(lens[b])
        x = draft[b, :k, None]
        p_x = p[b, :k].gather(-1, x).squeeze(-1)
        q_x = q[b, :k].gather(-1, x).squeeze(-1) if q is not None else torch.ones_like(p_x)
        n.append(first_rejection(accepts(u[b, :k], p_x, q_x)))
    return torch.tensor(n)


def tree_masks_reference(parents: Tensor) -> Tensor:
    return torch.stack([tree_mask(row) for row in parents.cpu()])


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _accept_greedy_kernel(logits_ptr, draft_ptr, lens_ptr, n_ptr, next_ptr, K1, V,
                              stride_lb, stride_lt, stride_db, BLOCK_V: tl.constexpr):
        b = tl.program_id(0)
        length = tl.load(lens_ptr + b)
        n = length * 0
        nxt = length * 0
        done = length * 0
        for j in range(0, K1):
            best_val = tl.full((), float("-inf"), tl.float32)
            best_idx = length * 0
            for v0 in range(0, V, BLOCK_V):  # running argmax over the vocabulary, first index wins ties
                offs = v0 + tl.arange(0, BLOCK_V)
                x = tl.load(logits_ptr + b * stride_lb + j * stride_lt + offs, mask=offs < V,
                            other=float("-inf")).to(tl.float32)
                m = tl.max(x, 0)
                i = (tl.argmax(x, 0) + v0).to(best_idx.dtype)
                take = m > best_val
                best_idx = tl.where(take, i, best_idx)
                best_val = tl.where(take, m, best_val)
            active = (done == 0) & (j <= length)
            d = tl.load(draft_ptr + b * stride_db + j, mask=j < length, other=-1).to(best_idx.dtype)
            match = (d == best_idx) & (j < length)
            n = tl.where(active & match, n + 1, n)
            nxt = tl.where(active & (match == 0), best_idx, nxt)
            done = tl.where(active & (match == 0), 1, done)
        tl.store(n_ptr + b, n)
        tl.store(next_ptr + b, nxt)

    @triton.jit
    def _accept_rejection_kernel(p_ptr, q_ptr, draft_ptr, lens_ptr, u_ptr, n_ptr, K,
                                 stride_pb, stride_pt, stride_qb, stride_qt, stride_db, stride_ub,
                                 HAS_Q: tl.constexpr):
        b = tl.program_id(0)
        length = tl.load(lens_ptr + b)
        n = length * 0
        done = length * 0
        for j in range(0, K):
            live = j < length
            x = tl.load(draft_ptr + b * stride_db + j, mask=live, other=0)
            p_x = tl.load(p_ptr + b * stride_pb + j * stride_pt + x, mask=live, other=0.0).to(tl.float32)
            if HAS_Q:
                q_x = tl.load(q_ptr + b * stride_qb + j * stride_qt + x, mask=live, other=1.0).to(tl.float32)
            else:
                q_x = 1.0
            u = tl.load(u_ptr + b * stride_ub + j, mask=live, other=1.0).to(tl.float32)
            ok = (u * q_x < p_x) & live & (done == 0)
            n = tl.where(ok, n + 1, n)
            done = tl.where(ok, done, 1)
        tl.store(n_ptr + b, n)

    @triton.jit
    def _tree_mask_kernel(parents_ptr, out_ptr, N, stride_pb, stride_ob, stride_or):
        b = tl.program_id(0)
        j = tl.program_id(1)  # input row: 0 = anchor, i + 1 = node i
        row = out_ptr + b * stride_ob + j * stride_or
        tl.store(row, 1)  # everyone sees the anchor
        cur = (j - 1).to(tl.int64)  # loop-carried: keep one dtype (parents are int64)
        for _ in range(0, N):  # walk up to the anchor: self, parent, grandparent, ...
            valid = cur >= 0
            tl.store(row + cur + 1, 1, mask=valid)
            cur = tl.where(valid, tl.load(parents_ptr + b * stride_pb + cur, mask=valid, other=-1), -1)


def accept_greedy_batched(draft: Tensor, lens: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
    """draft [B, K] (row b valid up to lens[b]), logits [B, K+1, V] -> (n_accepted [B], next_token [B])."""
    if not triton_usable(logits):
        return accept_greedy_reference(draft, lens, logits)
    B, K1, V = logits.shape
    logits = logits.contiguous()
    draft = draft.to(logits.device, torch.int64).contiguous()
    lens = lens.to(logits.device, torch.int64)
    n = torch.empty(B, dtype=torch.int64, device=logits.device)
    nxt = torch.empty_like(n)
    _accept_greedy_kernel[(B,)](logits, draft, lens, n, nxt, K1, V, logits.stride(0), logits.stride(1),
                                max(draft.stride(0), 1), BLOCK_V=1024)
    return n, nxt


def accept_rejection_batched(draft: Tensor, lens: Tensor, p: Tensor, q: Tensor | None, u: Tensor) -> Tensor:
    """Accepted count [B] of the lossless rule with the uniforms u [B, K]; q None = point-mass drafts.
    The residual/bonus token then comes from p[b, n] - q[b, n] (or p[b, n] when n == lens[b])."""
    if not triton_usable(p):
        return accept_rejection_reference(draft, lens, p, q, u)
    B, K = draft.shape
    p = p.contiguous()
    qq = q.contiguous() if q is not None else p
    draft = draft.to(p.device, torch.int64).contiguous()
    u = u.to(p.device, torch.float32).contiguous()
    n = torch.empty(B, dtype=torch.int64, device=p.device)
    _accept_rejection_kernel[(B,)](p, qq, draft, lens.to(p.device, torch.int64), u, n, K,
                                   p.stride(0), p.stride(1), qq.stride(0), qq.stride(1),
                                   max(draft.stride(0), 1), max(u.stride(0), 1), HAS_Q=q is not None)
    return n


def tree_masks(parents: Tensor) -> Tensor:
    """parents [B, N] (-1 = anchor; pad nodes with -1) -> ancestor-or-self masks [B, N+1, N+1]."""
    if not triton_usable(parents):
        return tree_masks_reference(parents)
    B, N = parents.shape
    parents = parents.to(torch.int64).contiguous()
    out = torch.zeros(B, N + 1, N + 1, dtype=torch.int8, device=parents.device)
    _tree_mask_kernel[(B, N + 1)](parents, out, N, max(parents.stride(0), 1), out.stride(0), out.stride(1))
    return out.bool()
