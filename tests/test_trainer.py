"""Trainer: loss goes down, the target stays frozen, resume after a kill reproduces the curve, checkpoints."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conf.schema import Config
from models.checkpoint import load_draft
from models.draft_vocab import DraftVocab
from models.errors import DraftheadsError


@pytest.fixture(scope="module")
def peaked_target():
    """Tiny 'bigram' target: layers output zero, so the next-token distribution is a peaked function (final norm
    x10) of the newest token alone: something definite for a head to learn in 20 steps."""
    from models.target import Target, tiny_random_llama

    model, tok = tiny_random_llama(num_layers=6, seed=1)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return Target(model, tok, "tiny-random-llama")


def tiny_features(target, n=8, T=40, seed=0):
    """In-memory features in the FeatureDataset item format; periodic token streams make the target predictable."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        period = int(torch.randint(2, 6, (1,), generator=g))
        motif = torch.randint(0, 256, (period,), generator=g)
        ids = motif.repeat(T // period + 1)[:T]
        out = target(ids[None])
        mask = torch.ones(T, dtype=torch.bool)
        mask[:4] = False  # a "prompt" that is not trained
        items.append({"input_ids": ids, "loss_mask": mask, "aux_hidden": out.aux_hidden[0].float(),
                      "final_hidden": out.final_hidden[0].float()})
    return items


def make_cfg(tmp_path, **train):
    cfg = OmegaConf.structured(Config)
    cfg.name, cfg.output_dir = "test", str(tmp_path)
    cfg.target.name = "tiny-random-llama"
    cfg.draft.k, cfg.draft.num_layers = 3, 1
    base = dict(steps=20, batch_size=2, lr=1e-2, warmup_steps=2, checkpoint_every=10, log_every=1, cod_decay=0.7)
    base.update(train)
    for key, v in base.items():
        cfg.train[key] = v
    return cfg


def losses(path):
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["stage"] == "soft_label" and "loss" in r}


@pytest.mark.parametrize("family,parallel", [("peagle", True), ("eagle3", False), ("medusa", True)])
def test_short_run_lowers_loss_and_keeps_target_frozen(peaked_target, tmp_path, family, parallel):
    tiny_target = peaked_target
    from train.trainer import train_draft

    feats = tiny_features(tiny_target)
    before = {k: v.clone() for k, v in tiny_target.model.state_dict().items()}
    cfg = make_cfg(tmp_path)
    cfg.draft.family, cfg.draft.parallel = family, parallel
    head_dir = train_draft(cfg, tiny_target, feats, tmp_path)
    curve = losses(tmp_path / "metrics.jsonl")
    first, last = sum(curve[s] for s in range(1, 6)) / 5, sum(curve[s] for s in range(16, 21)) / 5
    assert last < 0.92 * first, (first, last)  # measured: peagle/eagle3 5.92 -> 5.31, medusa 11.1 -> 5.06
    assert all(p.grad is None and not p.requires_grad for p in tiny_target.model.parameters())
    for k, v in tiny_target.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"lr", "temperature", "tokens_per_s", "acc_1", "acc_2", "acc_3"} <= set(row)
    head = load_draft(head_dir, tiny_target)
    assert head.family_name == family and head.k == 3
    assert (head_dir / "resolved_config.yaml").is_file() and (head_dir / "metrics.json").is_file()


def test_hidden_state_regression_pulls_the_head_onto_the_target_features(tiny_target, tmp_path):
    """train.hidden_weight: SmoothL1 of the head's LM-head input to the target's; off, it stays where KL leaves it."""
    from train.cod import cod_plan
    from train.trainer import collate, train_draft

    feats = tiny_features(tiny_target)
    batch = collate(feats, torch.device("cpu"))
    plan = cod_plan(batch["loss_mask"], batch["lengths"], 3, 1.0, torch.Generator().manual_seed(0))
    gap = {}
    for w in (0.0, 5.0):
        head = load_draft(train_draft(make_cfg(tmp_path / str(w), hidden_weight=w), tiny_target, feats,
                                      tmp_path / str(w)), tiny_target)
        with torch.no_grad():
            out = head(batch, plan)
            ref = batch["final_hidden"][out.batch_index, out.anchor + out.depth]
            gap[w] = float(torch.nn.functional.smooth_l1_loss(out.hidden.float(), ref.float()))
    assert gap[5.0] < 0.5 * gap[0.0], gap  # measured: 0.515 -> 0.096
    cfg = make_cfg(tmp_path / "m", hidden_weight=1.0)
    cfg.draft.family = "medusa"
    with pytest.raises(DraftheadsError, match="hidden_weight=1.0 regresses"):
        train_draft(cfg, tiny_target, feats, tmp_path / "m")


def test_round_start_weight_weighs_the_rows_greedy_serving_drafts_from(peaked_target, tmp_path):
    """train.round_start_weight=w: rows anchored at the head's greedy round starts weigh 1 + w, so the step's loss is a
    weighted mean between the all-anchor loss and the round-start-only loss; the run trains and lowers its loss."""
    from models.peagle import peagle_for_target
    from train.chain import round_start_mask, round_start_weights
    from train.trainer import prepare_batch, soft_label_loss, train_draft

    torch.manual_seed(0)
    head = peagle_for_target(peaked_target, k=3, num_layers=1, parallel=True)
    feats = tiny_features(peaked_target, n=4)
    batch = prepare_batch(feats, "cpu")
    starts = round_start_mask(head, peaked_target, batch, 3)
    assert torch.equal(round_start_weights(peaked_target, 3, 2.0)(head, batch), 1.0 + 2.0 * starts.float())
    tc = make_cfg(tmp_path).train

    def loss(weights):
        fn = soft_label_loss(peaked_target, tc, 3, "peagle", "cpu", anchor_weights=weights)
        return fn(head, batch, 0, 1.0)[0].item()

    plain, ones = loss(None), loss(lambda m, b: torch.ones(b["input_ids"].shape))
    at_starts, mixed = loss(lambda m, b: starts.float()), loss(round_start_weights(peaked_target, 3, 2.0))
    assert ones == plain and at_starts != plain
    assert min(plain, at_starts) < mixed < max(plain, at_starts)
    train_draft(make_cfg(tmp_path, round_start_weight=2.0), peaked_target, tiny_features(peaked_target), tmp_path)
    curve = losses(tmp_path / "metrics.jsonl")
    assert sum(curve[s] for s in range(16, 21)) < 0.92 * sum(curve[s] for s in range(1, 6)), curve


def test_resume_after_kill_reproduces_the_curve(tiny_target, tmp_path):
    from train.trainer import train_draft

    feats = tiny_features(tiny_target)
    full, killed = tmp_path / "full", tmp_path / "killed"
    train_draft(make_cfg(full, steps=8, checkpoint_every=3), tiny_target, feats, full)
    train_draft(make_cfg(killed, steps=8, checkpoint_every=3), tiny_target, feats, killed, stop_at_step=5)
    assert not (killed / "head").exists() and (killed / "checkpoints" / "step_3").is_dir()
    train_draft(make_cfg(killed, steps=8, checkpoint_every=3), tiny_target, feats, killed)  # resumes at step 3
    a, b = losses(full / "metrics.jsonl"), losses(killed / "metrics.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-5, abs=1e-6), s
    wa = load_draft(full / "head", tiny_target).state_dict()
    wb = load_draft(killed / "head", tiny_target).state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def test_holdout_validation_keeps_the_best_head(peaked_target, tmp_path):
    from train.trainer import train_draft

    feats = tiny_features(peaked_target, n=7) + tiny_features(peaked_target, n=3)  # held out: motifs seen in training
    cfg = make_cfg(tmp_path, steps=12, holdout_sequences=3, eval_every=4, lr=3e-2)
    head_dir = train_draft(cfg, peaked_target, feats, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r for r in rows if "val_loss" in r}
    assert sorted(val) == [4, 8, 12]
    assert val[12]["val_loss"] < val[4]["val_loss"]
    assert 1.0 <= val[12]["val_tau_est"] <= 1 + 3 and {"val_acc_1", "val_acc_2", "val_acc_3"} <= set(val[12])
    best_step = max(val, key=lambda s: (val[s]["val_tau_chain"], -s))  # the first step with the highest chain τ
    kept = json.loads((head_dir / "metrics.json").read_text())
    assert kept["best_step"] == best_step and kept["best_val_tau_chain"] == val[best_step]["val_tau_chain"]
    # val_tau_chain: the greedy chain walked over the held-out answers; the kept head, re-scored one sequence at a
    # time outside the trainer, walks the same rounds
    from train.chain import chain_fn
    from train.trainer import prepare_batch

    emitted, rounds = map(sum, zip(*(chain_fn(peaked_target, 3)(load_draft(head_dir, peaked_target),
                                                                prepare_batch([f], "cpu")) for f in feats[-3:])))
    assert 1.0 <= val[best_step]["val_tau_chain"] <= 1 + 3
    assert val[best_step]["val_tau_chain"] == round(emitted / rounds, 4)
    with pytest.raises(DraftheadsError, match="holdout_sequences=10 leaves nothing"):
        train_draft(make_cfg(tmp_path / "b", holdout_sequences=10), peaked_target, feats, tmp_path / "b")
    by_loss = train_draft(make_cfg(tmp_path / "c", steps=12, holdout_sequences=3, eval_every=4, lr=3e-2,
                                   keep_best_by="val_loss"), peaked_target, feats, tmp_path / "c")
    assert json.loads((by_loss / "metrics.json").read_text())["best_step"] == min(val, key=lambda s: val[s]["val_loss"])


def test_checkpoint_refuses_a_foreign_target(tiny_target, tmp_path):
    from models.checkpoint import save_draft
    from models.peagle import peagle_for_target
    from models.target import Target, tiny_random_llama

    head = peagle_for_target(tiny_target, k=2)
    save_draft(head, tmp_path / "h", tiny_target)
    other = Target(*tiny_random_llama(hidden_size=32, num_layers=6), "other-tiny")
    with pytest.raises(DraftheadsError, match=r"built for target 'tiny-random-llama'.*hidden_size: 64 there, 32 here"):
        load_draft(tmp_path / "h", other)
    other_layers = Target(*tiny_random_llama(num_layers=6), "tiny-random-llama", layer_ids=(0, 1, 2))
    with pytest.raises(DraftheadsError, match="layer_ids"):
        load_draft(tmp_path / "h", other_layers)
    with pytest.raises(DraftheadsError, match="not a draft checkpoint"):
        load_draft(tmp_path, tiny_target)
    renamed = Target(tiny_target.model, tiny_target.tokenizer, "tiny-finetune")  # same sizes and tokenizer
    with pytest.warns(UserWarning, match="trained on target 'tiny-random-llama' and is loaded onto 'tiny-finetune'"):
        load_draft(tmp_path / "h", renamed)


@pytest.mark.parametrize("family", ["peagle", "medusa"])
def test_draft_vocab_head_trains_and_maps(tiny_target, tmp_path, family):
    from train.trainer import train_draft

    feats = tiny_features(tiny_target)
    cfg = make_cfg(tmp_path, steps=4)
    cfg.draft.family, cfg.draft.draft_vocab_size = family, 64
    head = load_draft(train_draft(cfg, tiny_target, feats, tmp_path), tiny_target)
    ids = head.draft_ids
    assert ids.numel() == 64 and torch.equal(ids, torch.arange(64) + head.d2t) and int(head.t2d.sum()) == 64
    seen = torch.cat([f["input_ids"][f["loss_mask"]] for f in feats]).unique()
    assert set(seen.tolist()) <= set(ids.tolist())  # fewer than 64 distinct trained tokens: all of them are in
    logits = head.full_vocab_logits(torch.zeros(2, 64))
    assert logits.shape == (2, tiny_target.vocab_size) and torch.isinf(logits).sum() == 2 * (tiny_target.vocab_size - 64)


def test_target_ids_map_to_draft_indices_and_back():
    from models.draft_vocab import to_draft_ids

    vocab = DraftVocab(torch.tensor([3, 7, 8, 20]), 32)
    ids = torch.tensor([[7, 3, 5], [20, 8, 31]])
    assert to_draft_ids(vocab.t2d, ids, outside=-1).tolist() == [[1, 0, -1], [3, 2, -1]]
    inside = torch.arange(vocab.size)
    assert torch.equal(to_draft_ids(vocab.t2d, inside + vocab.d2t, outside=-1), inside)  # d2t's inverse


def test_trained_head_raises_tau(peaked_target, tmp_path):
    """soft_label training -> head:DIR source -> tau in the reference loop beats the untrained head."""
    from inference.generate import generate_plain, speculative_generate
    from inference.sampling import SamplingConfig
    from inference.sources.draft_head import head_source
    from models.checkpoint import save_draft
    from models.peagle import peagle_for_target
    from train.trainer import train_draft

    # like real data: the target's own (regenerated) continuations of random prompts, loss on the continuation
    feats = []
    for i in range(12):
        prompt = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(100 + i))
        cont = generate_plain(peaked_target, prompt, 32, SamplingConfig(temperature=1.0), seed=i, eos_ids=[])
        ids = torch.cat([prompt, torch.tensor(cont)])
        out = peaked_target(ids[None])
        feats.append({"input_ids": ids, "loss_mask": torch.arange(len(ids)) >= 8,
                      "aux_hidden": out.aux_hidden[0], "final_hidden": out.final_hidden[0]})
    save_draft(peagle_for_target(peaked_target, k=3), tmp_path / "untrained", peaked_target)
    trained = train_draft(make_cfg(tmp_path / "run", steps=100, log_every=10, checkpoint_every=100), peaked_target, feats, tmp_path / "run")
    taus = {}
    for name, d in (("untrained", tmp_path / "untrained"), ("trained", trained)):
        src = head_source(str(d), peaked_target)
        res = [speculative_generate(peaked_target, src, f["input_ids"][:10], 24, 3, SamplingConfig(), eos_ids=[])
               for f in feats[:4]]
        taus[name] = sum(r.stats.emitted for r in res) / sum(r.stats.rounds for r in res)
    print("tau", taus)
    assert taus["trained"] > 3.0 > 1.2 > taus["untrained"], taus  # K=3: tau <= 4
    # val_tau_chain's walk over the same greedy answers takes the rounds the decoding loop took
    from collections import Counter

    from models.checkpoint import load_draft
    from train.chain import agreement, simulate_chain
    from train.trainer import collate

    head = load_draft(trained, peaked_target)
    for f, r in zip(feats[:4], res):
        ids = torch.cat([f["input_ids"][:10], torch.tensor(r.tokens[0])])
        out = peaked_target(ids[None])
        item = {"input_ids": ids, "loss_mask": torch.arange(len(ids)) >= 10, "aux_hidden": out.aux_hidden[0],
                "final_hidden": out.final_hidden[0]}
        walked = simulate_chain(agreement(head, peaked_target, collate([item], "cpu"), 3)[0], item["loss_mask"])
        assert dict(Counter(a for _, a in walked)) == dict(r.stats.accept_hist) and len(walked) == r.stats.rounds
        assert walked[0][0] == 8 and sum(a + 1 for _, a in walked) == 24 == r.stats.emitted


def test_rl_objective_pieces():
    from train.rl import exact_accepted, expected_accepted

    alpha, q = torch.tensor([[1.0, 0.5, 0.5], [0.0, 1.0, 1.0]]), torch.full((2, 3), 0.4)
    assert expected_accepted(alpha, q, q).tolist() == [2.0, 2.0]  # every drawn token passes: depth k is reached
    assert expected_accepted(alpha, q / 2, q).tolist() == [1.375, 0.75]  # each passes w.p. 1/2: 1 + .5*.5 + .25*.5
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.3, 0.2, 0.9], [0.3, 0.0, 0.9]])
    assert exact_accepted(p, p.clone(), g).tolist() == [3, 1]  # q = p always accepts; p = 0 always rejects
    # acceptance frequency of one token = min(1, p/q)
    many = exact_accepted(torch.full((20000, 1), 0.2), torch.full((20000, 1), 0.5), g).float().mean()
    assert float(many) == pytest.approx(0.4, abs=0.02)


def test_two_stage_run_and_rl_resume(peaked_target, tmp_path):
    from train.trainer import train_draft

    feats = tiny_features(peaked_target)
    cfg = lambda d: make_cfg(d, steps=10, rl_steps=6, rl_lr=1e-3, checkpoint_every=3, stages=["soft_label", "rl"],  # noqa: E731
                             rl_max_context=30)
    full, killed = tmp_path / "full", tmp_path / "killed"
    train_draft(cfg(full), peaked_target, feats, full)
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == list(range(1, 7))
    assert {"reward", "expected_accepted", "alpha_1", "alpha_3"} <= set(rl[-1])
    assert 0 <= rl[-1]["expected_accepted"] <= 3 and 0 <= rl[-1]["alpha_1"] <= 1
    stage1 = load_draft(full / "head_soft_label", peaked_target).state_dict()
    final = load_draft(full / "head", peaked_target).state_dict()
    assert any(not torch.equal(stage1[k], final[k]) for k in stage1)
    # killed in stage 2 after its step 4 (checkpoint at 3), rerun: stage 1 is skipped, stage 2 resumes exactly
    train_draft(cfg(killed), peaked_target, feats, killed, stop_at_step=4)
    train_draft(cfg(killed), peaked_target, feats, killed)
    rl_b = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    rl_b = [r for r in rl_b if r["stage"] == "rl"]
    assert [r["step"] for r in rl_b] == list(range(1, 7))
    for a, b in zip(rl, rl_b):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)


def test_rl_logs_held_out_tau_before_and_after(peaked_target, tmp_path):
    """RL validates on the held-out split at step 0 and at the end (no best-keeping: its objective is not val_loss);
    greedy serving (rl_temperature=0) with a sharpened surrogate runs and reports the exact greedy reward."""
    from train.trainer import train_draft

    feats = tiny_features(peaked_target, n=10)
    cfg = make_cfg(tmp_path, steps=6, rl_steps=4, rl_lr=1e-3, stages=["soft_label", "rl"], rl_max_context=30,
                   holdout_sequences=2, eval_every=100, rl_temperature=0.0, rl_surrogate_temperature=0.25)
    train_draft(cfg, peaked_target, feats, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r["stage"] == "rl" and "val_tau_est" in r]
    assert [r["step"] for r in val] == [0, 4] and all(1.0 <= r["val_tau_est"] <= 4.0 for r in val)
    first_rl = next(r for r in rows if r["stage"] == "rl" and "reward" in r)
    assert first_rl["serve_temperature"] == 0.0 and 0 <= first_rl["reward"] <= 3
    assert not (tmp_path / "checkpoints_rl" / "best").exists()


CONF = Path(__file__).resolve().parents[1] / "conf"
DRAFTS = sorted(p.stem for p in (CONF / "draft").glob("*.yaml"))
TRAINS = sorted(p.stem for p in (CONF / "train").glob("*.yaml"))


@pytest.mark.parametrize("draft", DRAFTS)
def test_every_draft_config_composes_and_builds(tiny_target, draft):
    from hydra import compose, initialize_config_dir

    from conf.schema import register_configs
    from models.checkpoint import build_draft

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for train in TRAINS:
            cfg = compose(config_name="config", overrides=[f"draft={draft}", f"train={train}", "target=tiny"])
            assert cfg.train.stages
    d = cfg.draft
    vocab = None if d.draft_vocab_size is None else DraftVocab(torch.arange(200), tiny_target.vocab_size)
    head = build_draft(d.family, tiny_target, d.k, d.num_layers, d.parallel, vocab, d.share_lm_head)
    assert head.family_name == d.family and head.k == d.k


def test_trains_from_a_feature_directory_and_refuses_foreign_features(peaked_target, tmp_path):
    from data.features import extract_features
    from train.trainer import train_draft

    from data.features import FeatureDataset

    feats = [f for T in (24, 17, 30) for f in tiny_features(peaked_target, n=2, T=T)]
    extract_features(peaked_target, [(f["input_ids"], f["loss_mask"]) for f in feats], tmp_path / "features",
                     shard_tokens=60)
    assert FeatureDataset(tmp_path / "features").lengths() == [24, 24, 17, 17, 30, 30]  # several shards
    head = train_draft(make_cfg(tmp_path / "run", steps=3, length_grouped=True), peaked_target, tmp_path / "features",
                       tmp_path / "run")
    assert load_draft(head, peaked_target).k == 3
    from models.target import Target, tiny_random_llama

    other = Target(*tiny_random_llama(num_layers=6), "tiny-random-llama", layer_ids=(0, 2, 4))
    with pytest.raises(DraftheadsError, match="layer_ids"):
        train_draft(make_cfg(tmp_path / "run2", steps=3), other, tmp_path / "features", tmp_path / "run2")


def test_a_non_finite_loss_stops_training_and_saves_no_head(tiny_target, tmp_path):
    """NaN features (a damaged shard) make the loss NaN: a clear error at that step, no head written."""
    from train.trainer import train_draft

    feats = tiny_features(tiny_target)
    feats[3] = {**feats[3], "aux_hidden": torch.full_like(feats[3]["aux_hidden"], float("nan"))}
    with pytest.raises(DraftheadsError, match=r"soft_label: the loss is nan at step \d+; nothing was saved"):
        train_draft(make_cfg(tmp_path, steps=20), tiny_target, feats, tmp_path)
    assert not (tmp_path / "head").exists() and not (tmp_path / "head_soft_label").exists()


def test_a_resume_with_other_settings_is_refused_and_resume_false_starts_over(peaked_target, tmp_path):
    """Checkpoints and a finished stage-1 head record what shaped them: a rerun with another draft.k or learning rate
    names the difference instead of loading them; train.resume=false clears the stage's checkpoints and best weights,
    so nothing of the earlier run is compared against or returned."""
    from train.trainer import train_draft

    feats = tiny_features(peaked_target, n=7) + tiny_features(peaked_target, n=3)
    train_draft(make_cfg(tmp_path, steps=6, checkpoint_every=3), peaked_target, feats, tmp_path, stop_at_step=4)
    other_k = make_cfg(tmp_path, steps=6, checkpoint_every=3)
    other_k.draft.k = 4
    with pytest.raises(DraftheadsError, match=r"checkpoints in .* other settings \(draft.k: 3 there, 4 now\)"):
        train_draft(other_k, peaked_target, feats, tmp_path)
    good = make_cfg(tmp_path, steps=8, holdout_sequences=3, eval_every=2, lr=3e-2)
    with pytest.raises(DraftheadsError, match="train.holdout_sequences: 0 there, 3 now"):
        train_draft(good, peaked_target, feats, tmp_path)
    good.train.resume = False  # start over: the killed run's checkpoints go
    train_draft(good, peaked_target, feats, tmp_path)
    first = json.loads((tmp_path / "head" / "metrics.json").read_text())
    with pytest.raises(DraftheadsError, match=r"stage-1 head in .* other settings \(train.lr: 0.03 there, 1e-09 now"):
        train_draft(make_cfg(tmp_path, steps=8, holdout_sequences=3, eval_every=2, lr=1e-9), peaked_target, feats,
                    tmp_path)
    slow = make_cfg(tmp_path, steps=8, holdout_sequences=3, eval_every=2, lr=1e-9, resume=False)
    train_draft(slow, peaked_target, feats, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(val) == [2, 4, 6, 8]  # only the last run's lines
    second = json.loads((tmp_path / "head" / "metrics.json").read_text())
    assert second["best_val_loss"] == val[second["best_step"]] > first["best_val_loss"]  # its own best, not the earlier
    again = make_cfg(tmp_path, steps=8, holdout_sequences=3, eval_every=2, lr=3e-2, checkpoint_every=2, resume=False)
    train_draft(again, peaked_target, feats, tmp_path, stop_at_step=4)  # a fresh start, killed: the old head went
    assert not (tmp_path / "head_soft_label").exists()
    again.train.resume = True
    train_draft(again, peaked_target, feats, tmp_path)  # so the rerun resumes from step 4 instead of meeting it
    assert json.loads((tmp_path / "head" / "metrics.json").read_text())["best_val_loss"] < second["best_val_loss"]


def test_rl_killed_before_its_first_checkpoint_logs_step_0_once(peaked_target, tmp_path):
    from train.trainer import train_draft

    feats = tiny_features(peaked_target, n=10)
    cfg = make_cfg(tmp_path, steps=4, rl_steps=6, rl_lr=1e-3, stages=["soft_label", "rl"], rl_max_context=30,
                   holdout_sequences=2, eval_every=100, checkpoint_every=5)
    train_draft(cfg, peaked_target, feats, tmp_path, stop_at_step=None)  # stage 1 done, RL done
    rl_dir = tmp_path / "checkpoints_rl"
    import shutil

    shutil.rmtree(rl_dir)
    shutil.rmtree(tmp_path / "head")
    train_draft(cfg, peaked_target, feats, tmp_path, stop_at_step=2)  # RL killed before its step-5 checkpoint
    train_draft(cfg, peaked_target, feats, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [(r["step"], "val_tau_est" in r) for r in rows if r["stage"] == "rl"]
    assert rl == [(0, True), *[(s, False) for s in range(1, 7)], (6, True)]


def test_agreement_is_measured_against_the_whole_vocabulary_argmax(tiny_target):
    """A draft-vocab head cannot agree where the target's greedy token lies outside its vocabulary: with the features'
    target_argmax those rows are misses; the draft-vocab-only argmax (old features) counted some of them as hits."""
    from models.checkpoint import build_draft
    from models.draft_vocab import build_draft_vocab
    from train.trainer import soft_label_loss, validation_fn

    feats = tiny_features(tiny_target, n=6)
    full = []
    for f in feats:
        argmax = tiny_target.lm_head(f["final_hidden"]).argmax(-1)
        full.append({**f, "target_argmax": argmax})
    cfg = make_cfg(Path("."))
    vocab = build_draft_vocab(feats, 32, tiny_target.vocab_size)
    outside = sum(int((~vocab.t2d[f["target_argmax"]]).sum()) for f in full)
    assert outside > 0  # the random target often prefers tokens the data never trains
    torch.manual_seed(0)
    head = build_draft("peagle", tiny_target, 3, 1, True, vocab)
    results = {}
    for name, items in (("draft_vocab_only", feats), ("whole_vocab", full)):
        loss_on = soft_label_loss(tiny_target, cfg.train, 3, "peagle", tiny_target.device)
        results[name] = validation_fn(loss_on, items, 2, 3)(head)
    assert results["whole_vocab"]["val_loss"] == results["draft_vocab_only"]["val_loss"]  # the loss is unchanged
    accs = [sum(r[f"val_acc_{d}"] for d in (1, 2, 3)) for r in (results["whole_vocab"], results["draft_vocab_only"])]
    assert accs[0] < accs[1], results


def test_every_logged_step_says_where_its_time_went(tiny_target, tmp_path):
    from train.trainer import train_draft

    train_draft(make_cfg(tmp_path, steps=4, log_every=2), tiny_target, tiny_features(tiny_target), tmp_path)
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    parts = [row[k] for k in ("data_ms", "forward_ms", "backward_ms", "optimizer_ms")]
    assert all(p >= 0 for p in parts) and parts[1] > 0 and parts[2] > 0


@pytest.mark.parametrize("isa,intel,want", [((), True, "no"), (("avx512_bf16",), True, "no"),
                                            (("avx512_bf16", "amx_bf16"), True, "bf16"),
                                            (("avx512_bf16",), False, "bf16"), ((), False, "no")])
def test_auto_mixed_precision_follows_what_trains_faster(monkeypatch, isa, intel, want):
    """auto: bf16 with AMX, or AVX-512 BF16 on AMD; float32 on Intel's AVX-512 BF16 alone (0.6x there) and without."""
    from inference import cpu_kernels
    from train.distributed import resolve_mixed_precision

    monkeypatch.setattr(cpu_kernels, "bf16_instructions", lambda: isa)
    monkeypatch.setattr(cpu_kernels, "intel_cpu", lambda: intel)
    assert resolve_mixed_precision("auto", "cpu") == want
    assert resolve_mixed_precision("no", "cpu") == "no" and resolve_mixed_precision("bf16", "cpu") == "bf16"


@pytest.mark.parametrize("major,want", [(9, "bf16"), (7, "no")])
def test_auto_mixed_precision_on_cuda_asks_this_ranks_gpu(monkeypatch, major, want):
    """Rank 3 of a torchrun launch asks GPU 3 before set_device; asking the current device would open a context on
    GPU 0 from every rank."""
    import torch

    from train.distributed import resolve_mixed_precision

    asked = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or (major, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("asked the current device"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a: pytest.fail("asked the current device"))
    assert resolve_mixed_precision("auto", "cuda") == want and asked == [3]


def test_validation_reads_every_held_out_sequence_once(tiny_target):
    """3 held-out sequences in batches of 2: batches [0, 1] and [2], no sequence twice (a wrapped permutation used to
    count some twice); split over 2 ranks, the same batches in total."""
    from train.loop import Shard
    from train.trainer import validation_fn

    seen = []

    def loss_on(model, items, micro, temperature):
        seen.append([int(it["input_ids"][0]) for it in items])
        return torch.tensor(1.0), {f"acc_{d}": (1.0, 1) for d in (1, 2)}

    holdout = [{"input_ids": torch.tensor([i])} for i in range(3)]
    validation_fn(loss_on, holdout, 2, 2)(None)
    assert seen == [[0, 1], [2]]
    seen.clear()
    for rank in (0, 1):
        validation_fn(loss_on, holdout, 2, 2)(None, Shard(rank, 2, reduce=lambda t: t.means()))
    assert seen == [[0, 1], [2]]


def test_a_data_fraction_grows_the_training_set_and_keeps_the_held_out_one():
    from train.trainer import split_holdout

    data = list(range(100))
    splits = {f: split_holdout(data, 20, f) for f in (0.125, 0.25, 0.5, 1.0)}
    assert {f: len(t) for f, (t, _) in splits.items()} == {0.125: 10, 0.25: 20, 0.5: 40, 1.0: 80}
    assert all(list(h) == list(range(80, 100)) for _, h in splits.values())  # one held-out set for the whole curve
    assert list(splits[0.25][0]) == list(range(20))  # each fraction holds the smaller ones
    assert split_holdout(data, 0, 1.0) == (data, None)


def test_length_grouped_batches_cover_every_epoch_and_cut_the_padding():
    """train.length_grouped: the stream still reads every sequence once per epoch (any n, any batch size), the same
    micro gives the same batch, and right padding over chat-like lengths falls from ~45% to a few %."""
    from train.trainer import batch_indices

    g = torch.Generator().manual_seed(0)
    n, bs = 1001, 4  # n not a multiple of the batch: micro-batches straddle epochs
    lengths = tuple(int(x) for x in torch.randint(20, 768, (n,), generator=g))
    stream = [i for m in range(3 * n // bs) for i in batch_indices(m, bs, n, 0, lengths)]
    for e in range(2):
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))
    assert batch_indices(77, bs, n, 0, lengths) == batch_indices(77, bs, n, 0, lengths)

    def padding(grouped: bool) -> float:
        real = padded = 0
        for m in range(500):
            b = [lengths[i] for i in batch_indices(m, bs, n, 0, lengths if grouped else None)]
            real, padded = real + sum(b), padded + bs * max(b)
        return padded / real - 1

    assert padding(False) > 0.3 and padding(True) < 0.05
    assert batch_indices(5, bs, n, 0) == [int(torch.randperm(n, generator=torch.Generator().manual_seed(0))[i])
                                          for i in range(20, 24)]  # off: the plain permutation, as before


def test_a_finished_run_recorded_before_an_option_existed_still_resumes(tmp_path):
    """Settings recorded without a later option count it at its default; a real difference is still named."""
    from train.loop import check_settings

    now = {"stage": "soft_label", "train.lr": 0.001, "train.length_grouped": False}
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"stage": "soft_label", "train.lr": 0.001}))
    check_settings(path, now, "the head")
    with pytest.raises(DraftheadsError, match="train.length_grouped: False there, True now"):
        check_settings(path, {**now, "train.length_grouped": True}, "the head")
    check_settings(path, {**now, "processes": 2}, "the head")  # not recorded then: unknown, not compared
    path.write_text(json.dumps({**now, "processes": 2}))
    with pytest.raises(DraftheadsError, match="processes: 2 there, 1 now"):  # each step would read other data
        check_settings(path, {**now, "processes": 1}, "the head")
    check_settings(path, {**now, "processes": 1}, "the head", ignore=("processes",))  # a finished head, used as is
    for damaged in ('{"stage": "soft_la', '[1, 2]'):  # a torn write, or not an object: named, not a traceback
        path.write_text(damaged)
        with pytest.raises(DraftheadsError, match="settings.json' \\(the settings of the head\\) is damaged"):
            check_settings(path, now, "the head")


def test_the_target_lm_head_rows_are_made_once_in_the_matmul_dtype():
    """The loss reads the target's LM head restricted to the draft vocabulary for every chunk of rows: made once,
    cast to autocast's dtype when it is on, and made again when the ids or the weight change."""
    from train.trainer import lm_head_rows

    lm = torch.nn.Linear(8, 10, bias=False)
    ids = torch.tensor([3, 1, 7])
    w, b = lm_head_rows(lm, ids, "cpu")
    assert b is None and torch.equal(w, lm.weight[ids])
    assert lm_head_rows(lm, ids.clone(), "cpu")[0] is w  # same ids: the same tensor, not a new gather
    assert torch.equal(lm_head_rows(lm, torch.tensor([2, 1, 7]), "cpu")[0], lm.weight[[2, 1, 7]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wb, _ = lm_head_rows(lm, ids, "cpu")
    assert wb.dtype == torch.bfloat16 and torch.equal(wb, lm.weight[ids].bfloat16())
    with torch.no_grad():
        lm.weight[1].add_(1.0)  # changed in place: the cached rows are stale
    assert torch.equal(lm_head_rows(lm, ids, "cpu")[0], lm.weight[ids])
    assert torch.equal(lm_head_rows(lm, None, "cpu")[0], lm.weight)


def test_tokens_per_s_counts_training_steps_only(tmp_path):
    """A validation that takes 0.6 s falls inside the next log window: the window's tokens/s leaves it out (it used
    to be every fourth window's dip on the default run), and the validation row says how long it took."""
    import time
    from types import SimpleNamespace

    from accelerate import Accelerator

    from train.loop import RunLog, Stage, run_stage

    def step_fn(model, micro, temperature):
        time.sleep(0.02)
        return model(torch.ones(1, 2)).sum(), {"tokens": 100}

    def validate(model, shard=None):
        time.sleep(0.6)
        return {"val_loss": 1.0}

    stage = Stage("soft_label", steps=8, lr=1e-3, warmup=1, step_fn=step_fn, ckpt_root=tmp_path / "ckpt",
                  validate=validate)
    tc = SimpleNamespace(grad_accum=1, max_grad_norm=0.0, weight_decay=0.0, resume=True, log_every=2, eval_every=4,
                         checkpoint_every=100, temperature=SimpleNamespace(start=1.0, end=1.0, schedule="constant",
                                                                           steps=None))
    log = RunLog(tmp_path / "metrics.jsonl", main=True)
    assert run_stage(Accelerator(cpu=True), torch.nn.Linear(2, 1), stage, tc, log)[0]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    assert len(rates) == 4 and min(rates) > 200 / 0.5, rates  # 200 tokens per ~0.05 s window; ~0.65 s with the 0.6
    assert [r["val_s"] >= 0.6 for r in rows if "val_loss" in r] == [True, True]


def test_the_greedy_token_comes_from_the_features_without_the_target_lm_head():
    """Validation's chain walk needs only the target's greedy token: with target_argmax in the features no LM-head
    matmul runs (a target without one would fail), and a reduced vocabulary maps it to draft ids (-1 outside)."""
    from types import SimpleNamespace

    from train.trainer import target_greedy

    no_lm_head = SimpleNamespace(model=SimpleNamespace(get_output_embeddings=lambda: pytest.fail("LM head used")))
    t2d = torch.tensor([True, False, True, True, False])  # draft vocabulary: target ids 0, 2, 3
    head = SimpleNamespace(draft_ids=t2d.nonzero().flatten(), t2d=t2d)
    batch = {"target_argmax": torch.tensor([[3, 1, 2, 0]])}
    rows = SimpleNamespace(batch_index=torch.tensor([0, 0, 0]), anchor=torch.tensor([0, 0, 1]),
                           depth=torch.tensor([1, 2, 2]))
    assert target_greedy(no_lm_head, head, batch, rows, slice(0, None)).tolist() == [-1, 1, 0]


def test_steps_raised_train_on_steps_lowered_or_another_keep_best_criterion_are_refused(peaked_target, tmp_path):
    """A finished stage 1 asked for more steps trains on from its last checkpoint (RL's checkpoints of the old head
    go); asked for fewer than it ran, it is an error naming train.steps, not its weights returned as the shorter
    run's, and so is training on without the last checkpoint; a refused rerun keeps the head. A killed run resumed
    with the chain walk switched off (kept weights chosen by chain τ, the rest by val_loss) is refused; RL's
    train.rl_steps the same."""
    import shutil

    from train.trainer import train_draft

    feats = tiny_features(peaked_target, n=7) + tiny_features(peaked_target, n=3)
    cfg = lambda steps, **kw: make_cfg(tmp_path, steps=steps, holdout_sequences=3, eval_every=2, checkpoint_every=2,  # noqa: E731
                                       stages=["soft_label", "rl"], rl_max_context=30, **{"rl_steps": 2, **kw})
    train_draft(cfg(4), peaked_target, feats, tmp_path)
    with pytest.raises(DraftheadsError, match=r"at step 4, past the 2 steps asked for \(train.steps=2\); set "
                                              r"train.steps to 4 or more"):
        train_draft(cfg(2), peaked_target, feats, tmp_path)
    with pytest.raises(DraftheadsError, match=r"other settings \(train.lr"):
        train_draft(cfg(6, lr=3e-3), peaked_target, feats, tmp_path)
    assert (tmp_path / "head_soft_label" / "config.json").is_file()  # refused before anything was removed
    train_draft(cfg(6), peaked_target, feats, tmp_path)  # trains on: steps 5 and 6, then RL from the new head
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r and r["stage"] == "soft_label"] == list(range(1, 7))
    assert [r["step"] for r in rows if "loss" in r and r["stage"] == "rl"] == [1, 2]  # RL ran again, once
    assert json.loads((tmp_path / "head_soft_label" / "metrics.json").read_text())["steps"] == 6
    train_draft(cfg(10), peaked_target, feats, tmp_path, stop_at_step=9)  # an extension killed past a checkpoint:
    assert json.loads((tmp_path / "head_soft_label" / "metrics.json").read_text())["steps"] == 6  # its start stays
    train_draft(cfg(6), peaked_target, feats, tmp_path)  # ... and is what the old step count still gets
    assert json.loads((tmp_path / "head_soft_label" / "metrics.json").read_text())["steps"] == 6
    train_draft(cfg(8), peaked_target, feats, tmp_path)  # a shorter extension, resumed from the killed one's step 8
    assert json.loads((tmp_path / "head_soft_label" / "metrics.json").read_text())["steps"] == 8
    assert not (tmp_path / "head_soft_label.saving").exists()
    shutil.rmtree(tmp_path / "checkpoints")
    with pytest.raises(DraftheadsError, match=r"past its 8 steps, but its step-8 checkpoint is not in"):
        train_draft(cfg(10), peaked_target, feats, tmp_path)
    killed = tmp_path / "killed"
    train_draft(make_cfg(killed, steps=6, holdout_sequences=3, eval_every=2, checkpoint_every=2), peaked_target,
                feats, killed, stop_at_step=3)
    with pytest.raises(DraftheadsError, match="chosen by val_tau_chain, this run would choose by val_loss"):
        train_draft(make_cfg(killed, steps=6, holdout_sequences=3, eval_every=2, checkpoint_every=2,
                             val_tau_chain=False), peaked_target, feats, killed)
    with pytest.raises(DraftheadsError, match=r"checkpoints_rl/step_2' is at step 2, .*\(train.rl_steps=1\)"):
        train_draft(cfg(8, rl_steps=1), peaked_target, feats, tmp_path)


@pytest.mark.parametrize("target_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["peagle", "eagle3", "medusa", "dspark", "dflash"])
def test_a_bf16_head_without_autocast_trains_on_float32_features(tiny_target, family, target_dtype):
    """DeepSpeed's bf16 casts the head itself and turns autocast off, while features are decoded as float32 and the
    target's embedding / LM head keep the target's dtype: the head's first matmul failed on the dtype mismatch."""
    import copy

    from models.checkpoint import build_draft
    from models.target import Target
    from train.trainer import soft_label_loss

    feats = tiny_features(tiny_target, n=2)
    target = tiny_target if target_dtype == torch.float32 else \
        Target(copy.deepcopy(tiny_target.model).to(target_dtype), tiny_target.tokenizer, tiny_target.name)
    head = build_draft(family, target, 3).to(torch.bfloat16)
    tc = OmegaConf.structured(Config).train
    loss, _ = soft_label_loss(target, tc, 3, family, "cpu")(head, feats, 0, 1.0)
    loss.backward()
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and grads and all(g is not None and g.dtype == torch.bfloat16 for g in grads)


def test_rl_on_a_sharded_target_is_refused_before_stage_1_trains(tmp_path):
    from models.target import Target, tiny_random_llama
    from train.trainer import train_draft

    sharded = Target(*tiny_random_llama(num_layers=4), "tiny-random-llama", sharded=True)  # the flag is what RL reads
    with pytest.raises(DraftheadsError, match="RL scores drafts with the whole target on each rank"):
        train_draft(make_cfg(tmp_path, stages=["soft_label", "rl"]), sharded, [], tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_resume_false_is_checked_after_the_main_process_removed_the_old_checkpoints(tmp_path):
    """With 2+ processes the other ranks compare settings only after the barrier at which rank 0 has removed the
    earlier run's checkpoints (they used to read its settings first and refuse the fresh start)."""
    import shutil

    from train.loop import check_or_record_settings

    root = tmp_path / "checkpoints"
    check_or_record_settings(root, {"train.lr": 1.0}, main=True, resume=True)
    check_or_record_settings(root, {"train.lr": 2.0}, main=False, resume=False, wait=lambda: shutil.rmtree(root))
    check_or_record_settings(tmp_path / "x", {"train.lr": 1.0}, main=True, resume=True)
    with pytest.raises(DraftheadsError, match="train.lr: 1.0 there, 2.0 now"):  # a resume is still checked
        check_or_record_settings(tmp_path / "x", {"train.lr": 2.0}, main=False, resume=True)


def test_settings_are_checked_once_for_every_rank(tmp_path):
    """Under several processes the main rank checks (or records) the settings and every rank gets its outcome: a rank
    whose filesystem shows other settings no longer stops alone and leaves the others waiting in a collective."""
    from train.loop import check_or_record_settings

    root = tmp_path / "checkpoints"
    check_or_record_settings(root, {"train.lr": 1.0}, main=True, resume=True)
    main_saw = []
    check_or_record_settings(root, {"train.lr": 2.0}, main=False, resume=True, once=lambda compute: main_saw.append(1))
    assert main_saw == [1]  # the other rank did not read the file itself
    with pytest.raises(DraftheadsError, match="train.lr: 1.0 there, 2.0 now"):  # the main rank's check still refuses
        check_or_record_settings(root, {"train.lr": 2.0}, main=True, resume=True, once=lambda compute: compute())


def test_checkpoints_of_another_layout_are_refused_by_name(tmp_path):
    """DDP checkpoints resumed under DeepSpeed failed inside DeepSpeed and read as 'damaged' (delete it): the layout
    is a recorded setting, so the resume names it instead."""
    from train.loop import check_or_record_settings
    from train.trainer import stage_settings

    cfg = make_cfg(tmp_path)
    check_or_record_settings(tmp_path / "ckpt", stage_settings(cfg, "soft_label", None, None), main=True, resume=True)
    cfg.accelerate.strategy = "zero2"
    with pytest.raises(DraftheadsError, match="checkpoint_layout: 'plain' there, 'deepspeed' now"):
        check_or_record_settings(tmp_path / "ckpt", stage_settings(cfg, "soft_label", None, None), main=True,
                                 resume=True)
    cfg.accelerate.strategy = "ddp"  # the same layout as one process
    check_or_record_settings(tmp_path / "ckpt", stage_settings(cfg, "soft_label", None, None), main=True, resume=True)
