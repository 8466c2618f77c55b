"""Tree drafts: parent arrays, the tree attention mask, positions, and tree acceptance.

A tree draft is `Draft.parents` [N] with parents[i] < i (-1 = the anchor). The verification input is
[anchor, node 0 .. node N-1], so node i sits at input row i+1, position lengths + depth(i), and attends to
the committed cache plus its ancestors and itself. A chain is the tree parents = [-1, 0, 1, ..].

Acceptance walks from the anchor. At a node with target distribution p the children are tried in order;
child c (token x, draft distribution q_c, a point mass when the source gave no probs) is accepted with
probability min(1, p(x)/q_c(x)), otherwise p <- norm(max(0, p - q_c)) and the next child is tried; when all
fail a token is drawn from the final p. With one child per node this is exactly `verify.accept_rejection`,
and it is lossless for distinct deterministic children (point masses: rejected tokens are removed from p)
and for i.i.d. sampled children (SpecInfer's multi-draft rule). Greedy: follow the child equal to the
argmax; the token after the path is the argmax there, bit-identical to plain greedy decoding.
"""

from __future__ import annotations

import heapq

import torch
from torch import Tensor

from inference.sampling import SamplingConfig, greedy_tokens
from inference.sources.base import Draft
from inference.verify import accepts, point_mass, verify_chain


def chain_parents(k: int) -> Tensor:
    return torch.arange(k) - 1  # [-1, 0, 1, .., k-2]


def draft_parents(draft: Draft) -> Tensor:
    return draft.parents.long().cpu() if draft.parents is not None else chain_parents(draft.size)


def check_parents(parents: Tensor, what: str = "draft") -> None:
    idx = torch.arange(parents.numel())
    if bool(((parents >= idx) | (parents < -1)).any()):
        raise ValueError(f"{what}.parents {parents.tolist()} must satisfy -1 <= parents[i] < i (topological order)")


def tree_depths(parents: Tensor) -> Tensor:
    """depth [N] of each node (children of the anchor have depth 1)."""
    depth = torch.zeros(parents.numel(), dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        depth[i] = 1 if p < 0 else depth[p] + 1
    return depth


def tree_mask(parents: Tensor) -> Tensor:
    """Ancestor-or-self mask [N+1, N+1] over [anchor, nodes]: row j may attend to column i.
    The PyTorch reference of kernels.tree_mask_triton."""
    n = parents.numel()
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents.tolist()):  # parents come first: their rows are already complete
        mask[i + 1] |= mask[p + 1]
    return mask


def children_lists(parents: Tensor) -> list[list[int]]:
    """children[j] for j = input row (0 = anchor, i+1 = node i), as node indices in draft order."""
    out: list[list[int]] = [[] for _ in range(parents.numel() + 1)]
    for i, p in enumerate(parents.tolist()):
        out[p + 1].append(i)
    return out


def accept_tree(
    draft: Draft,
    target_logits: Tensor,  # [N+1, V] at [anchor, nodes]
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """-> (accepted node indices along the path, next token). Chains go through `verify.verify_chain`.
    At T > 0 siblings are tried in order, each against the residual the earlier ones left: exact for distinct point
    masses (every tree source today) and for siblings drawn independently from their draft.probs rows; siblings drawn
    WITHOUT replacement would need each q with the earlier siblings removed (not implemented)."""
    if draft.parents is None:
        n, nxt = verify_chain(draft, target_logits, sampling, generator)
        return list(range(n)), nxt
    parents = draft.parents.long().cpu()
    tokens = draft.tokens.cpu()
    kids = children_lists(parents)
    path: list[int] = []
    row = 0
    if sampling.greedy:
        while True:
            target_tok = int(greedy_tokens(target_logits[row]))
            match = [c for c in kids[row] if int(tokens[c]) == target_tok]
            if not match:
                return path, target_tok
            path.append(match[0])
            row = match[0] + 1
    probs = sampling.probs(target_logits)  # [N+1, V]
    while True:
        p = probs[row]
        accepted = None
        for c in kids[row]:
            x = int(tokens[c])
            q = draft.probs[c].to(p) if draft.probs is not None else point_mass(tokens[c], p.shape[-1]).to(p)
            u = torch.rand((), generator=generator, device=p.device)
            if accepts(u, p[x], q[x]):
                accepted = c
                break
            residual = (p - q).clamp_min(0)
            p = residual / residual.sum() if residual.sum() > 0 else p
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(accepted)
        row = accepted + 1


def best_first_tree(logp: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The n highest-scoring nodes of the tree whose depth-d children are every token of logp[d-1] [D, V], a node's
    score being the sum of logp along its path (the log path probability when positions are independent, as in
    parallel / Medusa heads) -> (tokens [m], parents [m]), m <= n, parents before children, best first.

    Lazy best-first enumeration: popping a node pushes its next-ranked sibling and its best child, both scored no
    higher than it, so nodes leave the heap in non-increasing score and every parent before its children."""
    D = logp.shape[0]
    width = min(n, logp.shape[-1])
    values, tokens = logp.float().topk(width, -1)  # [D, width], ranked per depth
    values, tokens = values.tolist(), tokens.tolist()
    heap = [(-values[0][0], 0, 0, 0, -1, 0.0)]  # (-score, tie-break, depth index, rank, parent node, parent score)
    out_tokens: list[int] = []
    out_parents: list[int] = []
    pushed = 1
    while heap and len(out_tokens) < n:
        neg, _, d, r, parent, parent_score = heapq.heappop(heap)
        if neg == float("inf"):  # -inf logp: outside a draft vocabulary, and so is everything after it
            break
        node, score = len(out_tokens), -neg
        out_tokens.append(tokens[d][r])
        out_parents.append(parent)
        if r + 1 < width:
            heapq.heappush(heap, (-(parent_score + values[d][r + 1]), pushed, d, r + 1, parent, parent_score))
            pushed += 1
        if d + 1 < D:
            heapq.heappush(heap, (-(score + values[d + 1][0]), pushed, d + 1, 0, node, score))
            pushed += 1
    return torch.tensor(out_tokens, dtype=torch.long), torch.tensor(out_parents, dtype=torch.long)
