"""Batched acceptance and tree-mask kernels against their references (and the references against verify.py).

The Triton tests run on CPU under the interpreter when triton is installed:
    TRITON_INTERPRET=1 python -m pytest tests/test_kernels.py
and skip cleanly otherwise (the CPU torch wheel ships no triton).
"""

import os

import pytest
import torch

from inference import kernels
from inference.tree import tree_mask
from inference.verify import accept_greedy, accept_rejection

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
needs_triton = pytest.mark.skipif(kernels.triton is None or not (ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"),
                                  reason="needs triton with a GPU or TRITON_INTERPRET=1 (the CPU torch wheel has none)")


def greedy_case(seed=0, B=5, K=4, V=300):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    draft = logits[:, :K].argmax(-1)  # start from all-accepted, then break some rows
    draft[1, 0] = (draft[1, 0] + 1) % V  # rejected at 0
    draft[2, 2] = (draft[2, 2] + 1) % V  # rejected at 2
    lens = torch.tensor([K, K, K, 0, 2])  # row 3: nothing drafted; row 4: a shorter draft
    return draft, lens, logits


def test_greedy_reference_matches_verify():
    draft, lens, logits = greedy_case()
    n, nxt = kernels.accept_greedy_reference(draft, lens, logits)
    assert n.tolist() == [4, 0, 2, 0, 2]
    for b in range(5):
        assert (int(n[b]), int(nxt[b])) == accept_greedy(draft[b, : lens[b]], logits[b, : lens[b] + 1])
    assert int(nxt[0]) == int(logits[0, 4].argmax()) and int(nxt[1]) == int(logits[1, 0].argmax())


def rejection_case(seed=0, B=6, K=5, V=50, point_mass=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(B, K + 1, V, generator=g).softmax(-1)
    q = torch.randn(B, K, V, generator=g).softmax(-1)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    lens = torch.tensor([K, K, 3, 0, K, 1])
    return draft, lens, p, None if point_mass else q


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_reference_matches_verify(point_mass):
    draft, lens, p, q = rejection_case(point_mass=point_mass)
    for seed in range(20):
        for b in range(draft.shape[0]):
            k = int(lens[b])
            qb = q[b, :k] if q is not None else torch.nn.functional.one_hot(draft[b, :k], p.shape[-1]).float()
            n_verify, _ = accept_rejection(draft[b, :k], p[b, : k + 1], qb, torch.Generator().manual_seed(seed))
            u = torch.rand(k, generator=torch.Generator().manual_seed(seed))  # the uniforms verify drew first
            n_ref = kernels.accept_rejection_reference(draft[b: b + 1, :k], lens[b: b + 1], p[b: b + 1],
                                                       None if q is None else q[b: b + 1], u[None])
            assert int(n_ref[0]) == n_verify


def test_tree_mask_reference():
    parents = torch.tensor([[-1, -1, 0, 2], [-1, 0, 1, 2]])  # a tree and a chain
    m = kernels.tree_masks_reference(parents)
    assert m[0, 4].tolist() == [True, True, False, True, True]  # node 3: anchor, 0, 2, itself
    assert m[0, 2].tolist() == [True, False, True, False, False]  # node 1 sees only the anchor and itself
    assert torch.equal(m[1], torch.ones(5, 5, dtype=torch.bool).tril())  # a chain is causal


@needs_triton
def test_greedy_kernel_matches_reference():
    for seed in range(3):
        draft, lens, logits = greedy_case(seed, V=2500)  # > BLOCK_V: the running argmax crosses blocks
        ref = kernels.accept_greedy_reference(draft, lens, logits)
        out = kernels.accept_greedy_batched(draft.to(DEVICE), lens.to(DEVICE), logits.to(DEVICE))
        assert torch.equal(out[0].cpu(), ref[0]) and torch.equal(out[1].cpu(), ref[1])


@needs_triton
@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_kernel_matches_reference(point_mass):
    draft, lens, p, q = rejection_case(point_mass=point_mass)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        u = torch.rand(draft.shape, generator=g)
        on = [None if t is None else t.to(DEVICE) for t in (draft, lens, p, q, u)]
        assert torch.equal(kernels.accept_rejection_batched(*on).cpu(),
                           kernels.accept_rejection_reference(draft, lens, p, q, u))


@needs_triton
def test_tree_mask_kernel_matches_reference():
    g = torch.Generator().manual_seed(0)
    N = 12
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, N)])
                           for _ in range(3)])
    out = kernels.tree_masks(parents.to(DEVICE)).cpu()
    assert torch.equal(out, kernels.tree_masks_reference(parents)) and torch.equal(out[0], tree_mask(parents[0]))
