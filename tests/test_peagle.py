"""P-EAGLE head: alignment (no off-by-one), training == inference numerics, one forward for K tokens, COD counts."""

import torch

from inference.tree import tree_depths
from models.peagle import peagle_for_target, DraftCache
from train.cod import cod_plan


def features(target, T=12, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    out = target(ids)
    return dict(input_ids=ids, aux_hidden=out.aux_hidden, final_hidden=out.final_hidden,
                loss_mask=torch.ones(B, T, dtype=torch.bool), lengths=torch.full((B,), T))


def test_cod_alignment_hand_built():
    # one sequence of 6 tokens, K=3, no sampling: depth d of anchor t exists while token t+d+1 exists
    mask = torch.ones(1, 6, dtype=torch.bool)
    plan = cod_plan(mask, torch.tensor([6]), k=3, decay=1.0)
    got = sorted((int(a), int(d)) for a, d, t in zip(plan.anchor[0], plan.depth[0], plan.trained[0]) if t)
    assert got == sorted([(0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (1, 2), (2, 2), (0, 3), (1, 3)])
    # label token index = anchor + depth + 1 is always a real token (< 6) and every deeper token has its predecessor
    assert all(a + d + 1 < 6 for a, d in got)
    for col in range(plan.anchor.shape[1]):
        if plan.depth[0, col] > 1 and plan.valid[0, col]:
            p = plan.predecessor[0, col]
            assert plan.anchor[0, p] == plan.anchor[0, col] and plan.depth[0, p] == plan.depth[0, col] - 1
    # loss mask: only token 5 trained -> only (anchor, depth) with anchor+depth+1 == 5 have labels
    only5 = torch.zeros(1, 6, dtype=torch.bool)
    only5[0, 5] = True
    plan = cod_plan(only5, torch.tensor([6]), k=3, decay=1.0)
    got = sorted((int(a), int(d)) for a, d, t in zip(plan.anchor[0], plan.depth[0], plan.trained[0]) if t)
    assert got == [(1, 3), (2, 2), (3, 1)]  # each label t+d+1 == 5 once per depth


def test_cod_keeps_designed_counts():
    mask = torch.ones(3, 200, dtype=torch.bool)
    plan = cod_plan(mask, torch.tensor([200, 200, 200]), k=5, decay=0.7, generator=torch.Generator().manual_seed(0))
    for b in range(3):
        per_depth = [int(((plan.depth[b] == d) & plan.valid[b]).sum()) for d in range(1, 6)]
        assert per_depth == [199] + [round(199 * 0.7 ** (d - 1)) for d in range(2, 6)] == [199, 139, 98, 68, 48]


def test_training_logits_equal_inference_logits(tiny_target):
    torch.manual_seed(0)
    batch = features(tiny_target, T=12, B=1)
    for parallel in (True, False):
        head = peagle_for_target(tiny_target, k=3, num_layers=2, parallel=parallel)
        plan = cod_plan(batch["loss_mask"], batch["lengths"], k=3, decay=1.0)
        out = head.train_forward(batch, plan)
        ids, aux = batch["input_ids"][0], batch["aux_hidden"][0]
        for t in (0, 4, 7):
            # inference at context tokens[:t+2] (newest token x_{t+1}, features of tokens[:t+1]) drafts x_{t+2..t+4}
            true_next = iter(ids[t + 2:].tolist())
            inf = head.draft_logits(ids[: t + 2], aux[: t + 1], DraftCache(), 3,
                                    sample_fn=lambda _logits: torch.tensor(next(true_next)))
            for d in (1, 2, 3):
                row = ((out.anchor == t) & (out.depth == d)).nonzero()
                assert row.numel() == 1
                torch.testing.assert_close(head.logits_for(out.hidden, out.depth)[row[0, 0]], inf[d - 1], atol=1e-5, rtol=1e-4)


def test_a_chain_head_trains_on_a_sequence_shorter_than_its_block(tiny_target):
    """A micro-batch shorter than K + 2 tokens ends the plan before depth K: the chain path asked for the missing
    depth's columns (IndexError); it now runs every depth, the missing ones empty, with the parallel path's rows."""
    batch = features(tiny_target, T=5, B=1)
    plan = cod_plan(batch["loss_mask"], batch["lengths"], k=5, decay=1.0)
    assert len(plan.blocks) - 1 < 5 and plan.depth_columns(5).numel() == 0
    rows = [head.train_forward(batch, plan).hidden.shape[0]
            for head in (peagle_for_target(tiny_target, k=5, parallel=p) for p in (True, False))]
    assert rows[0] == rows[1] > 0


def test_cache_reuse_matches_fresh(tiny_target):
    torch.manual_seed(0)
    batch = features(tiny_target, T=16, B=1)
    head = peagle_for_target(tiny_target, k=4, num_layers=1, parallel=True)
    ids, aux = batch["input_ids"][0], batch["aux_hidden"][0]
    cache = DraftCache()
    for T in (5, 9, 10, 14, 7):  # grows, then a rollback to a shorter context
        fresh = head.draft_logits(ids[:T], aux[: T - 1], DraftCache(), 4, None)
        cached = head.draft_logits(ids[:T], aux[: T - 1], cache, 4, None)
        torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-4)


def test_parallel_head_drafts_k_tokens_in_one_forward(tiny_target):
    batch = features(tiny_target, T=10, B=1)
    head = peagle_for_target(tiny_target, k=5, num_layers=1, parallel=True)
    calls = []
    head.layers[0].register_forward_hook(lambda *a: calls.append(1))
    logits = head.draft_logits(batch["input_ids"][0], batch["aux_hidden"][0, :9], DraftCache(), 5, None)
    assert logits.shape == (5, tiny_target.vocab_size) and len(calls) == 1
    chain = peagle_for_target(tiny_target, k=5, num_layers=1, parallel=False)
    calls.clear()
    chain.layers[0].register_forward_hook(lambda *a: calls.append(1))
    chain.draft_logits(batch["input_ids"][0], batch["aux_hidden"][0, :9], DraftCache(), 5, lambda lg: lg.argmax())
    assert len(calls) == 5


def test_head_source_is_lossless_in_the_reference_loop(tiny_target, tmp_path):
    """Greedy speculative decoding with a (random) head as the source equals plain greedy, parallel and chain."""
    from inference.generate import generate_plain, speculative_generate
    from inference.sampling import SamplingConfig
    from inference.sources.draft_head import head_source
    from models.checkpoint import save_draft

    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    plain = generate_plain(tiny_target, prompt, 12, SamplingConfig(), eos_ids=[])
    for parallel in (True, False):
        save_draft(peagle_for_target(tiny_target, k=3, parallel=parallel), tmp_path / str(parallel), tiny_target)
        src = head_source(str(tmp_path / str(parallel)), tiny_target)
        res = speculative_generate(tiny_target, src, prompt, 12, 3, SamplingConfig(), eos_ids=[])
        assert res.tokens == [plain]
        sampled = speculative_generate(tiny_target, src, prompt, 12, 3, SamplingConfig(temperature=0.9), eos_ids=[])
        assert len(sampled.tokens[0]) == 12
    # its sampling noise is not the verifier's: the runtime seeds its acceptance draws with the same run seed (0)
    fresh = head_source(str(tmp_path / "True"), tiny_target).generator
    assert fresh.initial_seed() != torch.Generator().manual_seed(0).initial_seed()


def test_sampled_drafts_follow_the_run_seed_not_the_source_history(tiny_target, tmp_path):
    """At T=1 a head source's draft draws restart from the run's seed: the same source run twice, and a fresh one,
    give the same tokens for the same seed (its draws used to go on from wherever the last run left them)."""
    from inference.runtime import Runtime
    from inference.sampling import SamplingConfig
    from inference.sources.draft_head import head_source
    from models.checkpoint import save_draft

    torch.manual_seed(0)
    save_draft(peagle_for_target(tiny_target, k=4), tmp_path / "h", tiny_target)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    rt, warm = Runtime(tiny_target, max_len=64), SamplingConfig(temperature=1.0)
    src = head_source(str(tmp_path / "h"), tiny_target)
    runs = [rt.generate([prompt], 20, source=s, k=4, sampling=warm, seed=0, ignore_eos=True).tokens
            for s in (src, src, head_source(str(tmp_path / "h"), tiny_target))]
    assert runs[0] == runs[1] == runs[2]


def test_trainer_labels_are_aligned_with_an_oracle_target():
    """An oracle 'target' whose row r distribution is one-hot on the TRUE token r+1: every (anchor, depth) row the
    trainer builds must get target argmax == its label token x_{anchor+depth+1} (no off-by-one anywhere)."""
    from types import SimpleNamespace

    from train.trainer import collate, draft_labels

    V = 16
    lm = torch.nn.Linear(V, V, bias=False)
    with torch.no_grad():
        lm.weight.copy_(torch.eye(V) * 10)
    oracle = SimpleNamespace(dtype=torch.float32, model=SimpleNamespace(get_output_embeddings=lambda: lm), lm_head=lm)
    g = torch.Generator().manual_seed(0)
    items = []
    for T in (11, 7):
        ids = torch.randint(0, V, (T,), generator=g)
        final = torch.nn.functional.one_hot(torch.cat([ids[1:], ids[:1]]), V).float()  # row r -> token r+1
        items.append({"input_ids": ids, "loss_mask": torch.rand(T, generator=g) > 0.3,
                      "aux_hidden": torch.zeros(T, 3), "final_hidden": final})
    batch = collate(items, "cpu")
    plan = cod_plan(batch["loss_mask"], batch["lengths"], k=4, decay=0.8, generator=g)
    keep = plan.valid & plan.trained
    out = SimpleNamespace(batch_index=torch.arange(2)[:, None].expand_as(keep)[keep], anchor=plan.anchor[keep],
                          depth=plan.depth[keep])
    head = SimpleNamespace(draft_ids=None)
    tgt, where, labels, _ = draft_labels(oracle, head, batch, out, slice(0, None))
    assert labels.numel() > 10 and tgt.shape[0] < labels.numel()  # rows that share a label position share logits
    assert torch.equal(tgt.argmax(-1)[where], labels)
    # and every label is a loss token inside its sequence
    pos = out.anchor + out.depth + 1
    assert (pos < batch["lengths"][out.batch_index]).all() and batch["loss_mask"][out.batch_index, pos].all()


def test_head_tree_drafts_are_lossless_in_the_runtime(tiny_target, tmp_path):
    """head:DIR,tree=1: one parallel forward -> a best-first token tree; greedy output equals plain greedy and the
    tree beats the chain's tau on the same head; chain heads and out-of-range depths are refused by name."""
    import pytest

    from inference.runtime import Runtime
    from inference.sampling import SamplingConfig
    from inference.sources.base import DraftContext
    from inference.sources.draft_head import head_source
    from models.checkpoint import save_draft
    from models.errors import DraftheadsError

    torch.manual_seed(0)
    save_draft(peagle_for_target(tiny_target, k=4), tmp_path / "par", tiny_target)
    save_draft(peagle_for_target(tiny_target, k=4, parallel=False), tmp_path / "chain", tiny_target)
    src = head_source(f"{tmp_path / 'par'},tree=1,depth=3", tiny_target)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    out = tiny_target(torch.tensor([prompt[:-1]]))
    draft = src.propose(DraftContext(torch.tensor(prompt), out.aux_hidden[0], out.final_hidden[0]), 10, SamplingConfig())
    assert draft.size == 10 and int(tree_depths(draft.parents).max()) <= 3
    rt = Runtime(tiny_target, max_len=64)
    plain = rt.generate([prompt], 20, ignore_eos=True).tokens
    tree = rt.generate([prompt], 20, source=src, k=10, ignore_eos=True)
    chain = rt.generate([prompt], 20, source=head_source(str(tmp_path / "par"), tiny_target), k=3, ignore_eos=True)
    assert tree.tokens == plain and chain.tokens == plain
    assert tree.stats.tau >= chain.stats.tau
    sampled = rt.generate([prompt], 20, source=src, k=10, sampling=SamplingConfig(temperature=1.0), ignore_eos=True)
    assert len(sampled.tokens[0]) == 20
    with pytest.raises(DraftheadsError, match="drafts one chain, so drop tree=1"):
        head_source(f"{tmp_path / 'chain'},tree=1", tiny_target)
    with pytest.raises(DraftheadsError, match="depth=5 must be between 1 and the head's K=4"):
        head_source(f"{tmp_path / 'par'},tree=1,depth=5", tiny_target)
    with pytest.raises(DraftheadsError, match="'tre=1' is not KEY=VALUE"):
        head_source(f"{tmp_path / 'par'},tre=1", tiny_target)
