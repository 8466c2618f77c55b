"""Stage-2 RL pieces: many blocks per sequence are scored exactly and trained with inference numerics."""

import pytest
import torch
import torch.nn.functional as F

from inference.llama import LlamaForward
from models.dspark import dspark_for_target
from models.peagle import DraftCache, peagle_for_target
from train.rl import block_batch, block_logits, block_plan, pick_anchors, score_blocks

K = 4


def blocks(target, B=2, T=30, seed=0):
    """Two random sequences with their features, 3 anchors each (row 1 padded: its last anchor repeats), blocks y."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    out = target(ids)
    items = [{"input_ids": ids[b], "aux_hidden": out.aux_hidden[b], "final_hidden": out.final_hidden[b]}
             for b in range(B)]
    anchors = torch.tensor([[2, 9, 17], [5, 11, 11]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    y = torch.randint(0, 256, (B, 3, K), generator=g)
    contexts = [ids[b, : int(anchors[b][valid[b]].max()) + 2] for b in range(B)]
    return items, contexts, anchors, valid, y


def test_score_blocks_equals_one_forward_per_block(tiny_target):
    items, contexts, anchors, valid, y = blocks(tiny_target)
    got = score_blocks(LlamaForward(tiny_target), contexts, anchors, y)  # [B, M, K, V]
    for b in range(2):
        for m in range(3):
            if not valid[b, m]:
                continue
            a = int(anchors[b, m])
            seq = torch.cat([items[b]["input_ids"][: a + 2], y[b, m, : K - 1]])
            want = tiny_target(seq[None]).logits[0, a + 1:].float()  # after x_{a+1}, then after y_1..y_{K-1}
            torch.testing.assert_close(got[b, m], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["parallel", "chain", "dspark"])
def test_block_training_logits_equal_inference(tiny_target, family):
    torch.manual_seed(0)
    head = dspark_for_target(tiny_target, k=K) if family == "dspark" else \
        peagle_for_target(tiny_target, k=K, num_layers=2, parallel=family == "parallel")
    items, contexts, anchors, valid, y = blocks(tiny_target)
    batch, plan = block_batch(items, contexts, anchors, valid, y)
    got = F.log_softmax(block_logits(head, head(batch, plan), anchors, valid, K), -1)  # [N, K, V], (b, m) order
    n = 0
    for b in range(2):
        for m in range(3):
            if not valid[b, m]:
                continue
            a = int(anchors[b, m])
            fed = iter(y[b, m].tolist())  # chain heads read the drafted tokens back
            inf = head.draft_logits(items[b]["input_ids"][: a + 2], items[b][head.feature][: a + 1], DraftCache(), K,
                                    lambda _logits: torch.tensor(next(fed)))
            want = F.log_softmax(head.full_vocab_logits(inf.float()), -1)
            torch.testing.assert_close(got[n], want, atol=1e-4, rtol=1e-4)
            n += 1
    assert n == got.shape[0] == 5


def test_block_plan_and_anchors():
    plan = block_plan(torch.tensor([[1, 4], [2, 2]]), torch.tensor([[True, True], [True, False]]), k=3)
    assert plan.blocks == [0, 5, 7, 9]
    rows = lambda b: sorted((int(a), int(d)) for a, d, t in zip(plan.anchor[b], plan.depth[b], plan.trained[b]) if t)  # noqa: E731
    assert rows(0) == [(1, 1), (1, 2), (1, 3), (4, 1), (4, 2), (4, 3)]
    assert rows(1) == [(2, 1), (2, 2), (2, 3)]
    for b in range(2):  # every deeper column's predecessor is its own anchor one depth up
        for col in range(5, 9):
            if plan.valid[b, col]:
                p = plan.predecessor[b, col]
                assert plan.anchor[b, p] == plan.anchor[b, col] and plan.depth[b, p] == plan.depth[b, col] - 1
    item = {"input_ids": torch.arange(40), "loss_mask": torch.arange(40) >= 20}
    got = pick_anchors(item, 8, 30, torch.Generator().manual_seed(0))
    assert len(got) == 8 == len(set(got)) and got == sorted(got) and all(18 <= a <= 28 for a in got)
