"""Tree drafts: masks, depths, acceptance walks (greedy and sampled) with numbers worked out by hand."""

import pytest
import torch

from inference.sampling import SamplingConfig
from inference.sources.base import Draft
from inference.tree import accept_tree, chain_parents, check_parents, children_lists, tree_depths, tree_mask
from inference.verify import verify_chain

V = 10


def logits_for(argmaxes):
    """Logits rows [len, V] whose argmax is the given token per row."""
    out = torch.zeros(len(argmaxes), V)
    out[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return out


#       anchor
#      /      \
#   n0=3      n1=4
#    |        /  \
#   n2=5   n3=6  n4=7
PARENTS = torch.tensor([-1, -1, 0, 1, 1])
TOKENS = torch.tensor([3, 4, 5, 6, 7])


def test_mask_depths_children():
    m = tree_mask(PARENTS)
    assert m[5].tolist() == [True, False, True, False, False, True]  # n4: anchor, n1, itself
    assert m[3].tolist() == [True, True, False, True, False, False]  # n2: anchor, n0, itself
    assert tree_depths(PARENTS).tolist() == [1, 1, 2, 2, 2]
    assert children_lists(PARENTS) == [[0, 1], [2], [3, 4], [], [], []]
    assert torch.equal(tree_mask(chain_parents(4)), torch.ones(5, 5, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="topological"):
        check_parents(torch.tensor([-1, 2, 0]))


def test_greedy_walk():
    # rows: anchor, n0, n1, n2, n3, n4 -> target argmax at each
    draft = Draft(TOKENS, parents=PARENTS)
    # anchor wants 4 (n1), n1 wants 7 (n4), n4 wants 9 (bonus)
    assert accept_tree(draft, logits_for([4, 0, 7, 0, 0, 9]), SamplingConfig()) == ([1, 4], 9)
    # anchor wants 3 (n0), n0 wants 8 (no child 8): stop with 8
    assert accept_tree(draft, logits_for([3, 8, 0, 0, 0, 0]), SamplingConfig()) == ([0], 8)
    # anchor wants 2: nothing accepted
    assert accept_tree(draft, logits_for([2, 0, 0, 0, 0, 0]), SamplingConfig()) == ([], 2)


def test_chain_goes_through_the_one_verifier():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    draft = Draft(logits[:3].argmax(-1))
    draft.tokens[2] = (draft.tokens[2] + 1) % V
    n, nxt = verify_chain(draft, logits, SamplingConfig())
    assert accept_tree(draft, logits, SamplingConfig()) == (list(range(n)), nxt) == ([0, 1], int(logits[2].argmax()))
    # the same chain written as an explicit tree walks the same path
    tree = Draft(draft.tokens, parents=chain_parents(3))
    assert accept_tree(tree, logits, SamplingConfig()) == ([0, 1], nxt)


def test_sampled_children_follow_target_distribution():
    """Two point-mass children a, b of the anchor: P(first token = x) must equal p(x) for every x."""
    p = torch.tensor([0.1, 0.4, 0.2, 0.3] + [0.0] * (V - 4))
    logits = torch.log(p.clamp_min(1e-12))[None].expand(2, -1).clone()  # anchor row + row of node 0
    draft = Draft(torch.tensor([3, 1]), parents=torch.tensor([-1, -1]))
    sampling = SamplingConfig(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    n_paths = torch.zeros(3)
    for _ in range(6000):
        path, nxt = accept_tree(draft, logits[[0, 0, 0]], sampling, g)
        first = int(draft.tokens[path[0]]) if path else nxt
        counts[first] += 1
        n_paths[len(path)] += 1
    emp = counts / counts.sum()
    assert (emp - p).abs().max() < 0.02
    # child 3 is accepted with prob p(3) = 0.3; child 1 then with p'(1) = 0.4 / 0.7 -> overall 0.4
    assert abs(n_paths[1].item() / 6000 - 0.7) < 0.02


def test_best_first_tree_by_hand():
    """Independent positions: path score = product of per-depth probabilities; the 5 best nodes, best first."""
    from inference.tree import best_first_tree

    logp = torch.full((2, V), float("-inf"))
    logp[0, [1, 2, 3]] = torch.tensor([0.6, 0.3, 0.1]).log()  # depth 1: a=1, b=2, c=3
    logp[1, [7, 8, 9]] = torch.tensor([0.7, 0.2, 0.1]).log()  # depth 2: x=7, y=8, z=9
    tokens, parents = best_first_tree(logp, 5)
    # a .6, ax .42, b .3, bx .21, ay .12 (c .1 and the rest fall off)
    assert tokens.tolist() == [1, 7, 2, 7, 8] and parents.tolist() == [-1, 0, -1, 2, 0]
    # the budget exceeds the finite paths: stops at the first -inf instead of proposing impossible tokens
    tokens, parents = best_first_tree(logp, 50)
    assert tokens.numel() == 3 + 9


def test_best_first_tree_keeps_the_n_best_paths():
    from itertools import product

    from inference.tree import best_first_tree

    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(3, 6, generator=g) * 2, -1)
    for n in (1, 4, 11, 30):
        tokens, parents = best_first_tree(logp, n)
        check_parents(parents)
        depth = tree_depths(parents)
        scores = []
        for i in range(n):
            s, node = 0.0, i
            while node >= 0:
                s += float(logp[depth[node] - 1, tokens[node]])
                node = int(parents[node])
            scores.append(s)
        every = sorted((sum(float(logp[d, t]) for d, t in enumerate(path)) for D in (1, 2, 3)
                        for path in product(range(6), repeat=D)), reverse=True)
        assert scores == pytest.approx(every[:n], abs=1e-5)  # the n best, best first
        assert len({(int(p), int(t)) for p, t in zip(parents, tokens)}) == n  # siblings are distinct tokens
