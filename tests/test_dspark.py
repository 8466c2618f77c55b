"""DSpark / DFlash block drafter: the backbone mask, exact left-to-right probabilities, lossless decoding, training
(soft labels + RL), checkpoints, Sequential Temperature Scaling and the embedded checkpoint. Tiny targets only."""

import json

import pytest
import torch

from inference.generate import generate_plain, speculative_generate
from inference.sampling import SamplingConfig
from models.checkpoint import load_draft, save_draft
from models.dspark import dspark_for_target
from models.errors import DraftheadsError
from models.peagle import DraftCache
from models.target import Target, tiny_random_llama
from tests.test_trainer import losses, make_cfg, peaked_target, tiny_features  # noqa: F401 (fixture)
from train.cod import anchor_plan

K = 4


@pytest.fixture(scope="module")
def target5():
    """Tiny random target whose features are 5 layers, as the experiments use (5 of SmolLM2's 30)."""
    model, tok = tiny_random_llama(num_layers=6)
    return Target(model, tok, "tiny-random-llama", layer_ids=(1, 2, 3, 4, 5))


def make_head(target, sequential="markov", seed=0, k=K):
    torch.manual_seed(seed)
    head = dspark_for_target(target, k=k, num_layers=2, sequential=sequential, rank=8).eval()
    if head.rank:  # a visible Markov bias (fresh heads start with W2 = 0)
        with torch.no_grad():
            head.W2.weight.normal_(0, 1.0)
            if sequential == "gated":  # and a gate that varies with h_k
                head.gate.weight.normal_(0, 1.0)
    return head


def features(target, T=20, seed=0):
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(seed))
    out = target(ids)
    return {"input_ids": ids, "aux_hidden": out.aux_hidden, "final_hidden": out.final_hidden}


def one_block(a):
    """A plan with one block: anchor a, slots 1..K, all labelled."""
    from train.cod import CodPlan

    yes = torch.ones(1, K, dtype=torch.bool)
    return CodPlan(torch.full((1, K), a), torch.arange(1, K + 1)[None], yes, yes, torch.full((1, K), -1), [0, K])


def test_block_sees_context_up_to_the_anchor_and_the_whole_block(target5):
    head = make_head(target5)
    batch = features(target5)
    a, H = 8, head.hidden_size
    plan = one_block(a)
    base = head(batch, plan).hidden[:, :H]  # [K, H] backbone outputs of the block
    later = {**batch, "aux_hidden": batch["aux_hidden"].clone(), "input_ids": batch["input_ids"].clone()}
    later["aux_hidden"][0, a + 1:] += 5.0  # features after the anchor
    later["input_ids"][0, a + 2:] = 7  # tokens after the anchor token x_{a+1}
    torch.testing.assert_close(head(later, plan).hidden[:, :H], base)
    earlier = {**batch, "aux_hidden": batch["aux_hidden"].clone()}
    earlier["aux_hidden"][0, a] += 5.0  # the anchor's own features ARE context
    assert (head(earlier, plan).hidden[:, :H] - base).abs().max() > 1e-3
    # bidirectional inside the block: slot 1 depends on the mask embedding every slot 2..K reads
    head2 = make_head(target5)
    with torch.no_grad():
        head2.mask_embedding.add_(1.0)
    assert (head2(batch, plan).hidden[0, :H] - base[0]).abs().max() > 1e-4


@pytest.mark.parametrize("sequential", ["markov", "gated", "rnn", "none"])
def test_training_rows_equal_inference_rows(target5, sequential):
    """Teacher-forced training logits == left-to-right inference logits fed the true tokens, every anchor."""
    head = make_head(target5, sequential)
    batch = features(target5)
    ids, aux = batch["input_ids"][0], batch["aux_hidden"][0]
    plan = anchor_plan(torch.ones(1, 20, dtype=torch.bool), torch.tensor([20]), K, anchors=6,
                       generator=torch.Generator().manual_seed(1))
    out = head(batch, plan)
    logits, cache = head.logits_for(out.hidden, out.depth), DraftCache()
    for a in sorted(set(out.anchor.tolist())):
        true = iter(ids[a + 2:].tolist())
        inf, conf = head.draft(ids[: a + 2], aux[: a + 1], cache, K, lambda _lg: torch.tensor(next(true)))
        for d in range(1, K + 1):
            row = ((out.anchor == a) & (out.depth == d)).nonzero()
            if row.numel():
                torch.testing.assert_close(logits[row[0, 0]], inf[d - 1], atol=1e-4, rtol=1e-4)
                c = torch.sigmoid(head.confidence_logit(out.hidden[row[0]], out.depth[row[0]]))[0]
                torch.testing.assert_close(c, conf[d - 1], atol=1e-5, rtol=1e-4)


def test_draft_probs_are_the_exact_markov_biased_softmax(target5):
    from inference.sources.base import DraftContext
    from inference.sources.dspark import DSparkSource

    head = make_head(target5)
    batch = features(target5, T=12)
    sampling = SamplingConfig(temperature=0.8, top_k=50)
    src = DSparkSource(head, "dspark", seed=3)
    ctx = DraftContext(batch["input_ids"][0], batch["aux_hidden"][0, :11], batch["final_hidden"][0, :11])
    draft = src.propose(ctx, K, sampling)
    assert draft.tokens.shape == (K,) and draft.probs.shape == (K, 259) and draft.confidences.shape == (K,)
    assert ((draft.confidences > 0) & (draft.confidences < 1)).all()
    # recompute independently: backbone h from a fresh forward; logits_k = lm_head(h_k) + W1[x_{k-1}] @ W2
    h = head.backbone(ctx.tokens[None, -1:], torch.arange(11, 11 + K)[None], head.contexts(ctx.aux_hidden[None],
                      torch.arange(11)[None]), None)[0, 0]
    prev = torch.cat([ctx.tokens[-1:], draft.tokens[:-1]])
    expected = target5.lm_head(h) + head.W1.weight[prev] @ head.W2.weight.T
    torch.testing.assert_close(draft.probs, sampling.probs(expected), atol=1e-5, rtol=1e-4)
    assert all(draft.probs[j, draft.tokens[j]] > 0 for j in range(K))
    # the bias matters: with another previous token the row differs (so ignoring x_{k-1} would be caught)
    other = target5.lm_head(h[1]) + head.W1.weight[(prev[1] + 1) % 256] @ head.W2.weight.T
    assert (sampling.probs(other) - draft.probs[1]).abs().max() > 1e-3
    # greedy: the argmax chain through the bias, point mass (no probs)
    g = src.propose(ctx, K, SamplingConfig())
    assert g.probs is None
    chain = [int(ctx.tokens[-1])]
    for j in range(K):
        chain.append(int((target5.lm_head(h[j]) + head.W1.weight[chain[-1]] @ head.W2.weight.T).argmax()))
    assert g.tokens.tolist() == chain[1:]


def test_gated_bias_is_the_previous_token_embedding_gated_by_the_backbone_state(target5):
    head = make_head(target5, "gated")
    h, prev = torch.randn(3, head.hidden_size), torch.tensor([5, 9, 200])
    e = head.W1.weight[prev]
    row = torch.cat([h, head.sequential_features(prev[None])[0]], -1)
    expected = target5.lm_head(h) + (e * torch.sigmoid(head.gate(h))) @ head.W2.weight.T
    torch.testing.assert_close(head.logits_for(row), expected)
    assert (head.logits_for(row) - (target5.lm_head(h) + e @ head.W2.weight.T)).abs().max() > 1e-2  # not markov's


def test_greedy_speculative_equals_plain_and_head_source_dispatch(target5, tmp_path):
    from inference.sources import build_source
    from inference.sources.dspark import DSparkSource

    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    plain = generate_plain(target5, prompt, 12, SamplingConfig(), eos_ids=[])
    for seq in ("markov", "gated", "rnn", "none"):
        save_draft(make_head(target5, seq), tmp_path / seq, target5)
        src = build_source(f"head:{tmp_path / seq}", target5)
        assert isinstance(src, DSparkSource)
        assert speculative_generate(target5, src, prompt, 12, K, SamplingConfig(), eos_ids=[]).tokens == [plain]


def test_runtime_confidence_prefix_cuts_dspark_drafts_losslessly(target5):
    """The runtime's ConfidencePrefix reads Draft.confidences: confident heads keep long drafts, unsure ones short."""
    from inference.runtime import Runtime
    from inference.schedulers import ConfidencePrefix, VerifyCost
    from inference.sources.dspark import DSparkSource

    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = generate_plain(target5, prompt, 12, SamplingConfig(), eos_ids=[])
    rt = Runtime(target5, max_len=64, batch_size=1)
    kept = {}
    for bias in (8.0, -8.0):  # c_k ~ 1 or ~ 0
        head = make_head(target5)
        with torch.no_grad():
            head.confidence.bias.fill_(bias)
        prefix = ConfidencePrefix(VerifyCost([1, 2, 8], [1.0, 1.05, 1.4]))
        g = rt.generate([prompt], 12, source=[DSparkSource(head, "dspark")], k=K, prefix=prefix, ignore_eos=True)
        assert g.tokens[0] == plain
        kept[bias] = max(prefix.kept)
    assert kept == {8.0: K, -8.0: 0}


def test_prefix_warns_when_confidences_were_calibrated_for_another_temperature(target5, tmp_path):
    """train.calibration records its temperature with the head; serving through the prefix scheduler at another one
    warns (the survival rates it multiplies are for the other T) and still decodes losslessly."""
    import warnings

    from inference.runtime import Runtime
    from inference.schedulers import ConfidencePrefix, VerifyCost
    from inference.sources import build_source

    save_draft(make_head(target5), tmp_path / "head", target5, metrics={"calibration": {"temperature": 0.0}})
    source = build_source(f"head:{tmp_path / 'head'}", target5)
    assert source.calibrated_at == 0.0
    rt = Runtime(target5, max_len=64, batch_size=1)
    prompt = list(range(3, 12))
    for temperature, warned in ((0.0, False), (1.0, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rt.generate([prompt], 6, source=[source], sampling=SamplingConfig(temperature=temperature), k=K,
                        prefix=ConfidencePrefix(VerifyCost([1, 2, 8], [1.0, 1.05, 1.4])), ignore_eos=True)
        messages = [str(w.message) for w in caught if "calibrated at T=0" in str(w.message)]
        assert bool(messages) == warned, messages
    assert "serves at T=1" in messages[0] and "--temperature 1" in messages[0]
    save_draft(make_head(target5), tmp_path / "plain", target5)  # never calibrated: nothing to compare
    assert build_source(f"head:{tmp_path / 'plain'}", target5).calibrated_at is None


def test_sampling_matches_target_distribution(target5):
    """T>0 through the runtime, one DSpark source per request: the first two emitted tokens follow the target's
    distribution. The head is biased towards the target's top-5 so drafts are often accepted, but q != p."""
    from inference.runtime import Runtime
    from inference.sources.dspark import DSparkSource

    sampling = SamplingConfig(temperature=1.0, top_k=5)
    prompt = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(5)).tolist()
    p1 = sampling.probs(target5(torch.tensor([prompt])).logits[0, -1])
    support = p1.topk(5).indices
    head = make_head(target5)
    with torch.no_grad():  # bias = e_0 . W2 = +3 on the support whatever the previous token
        head.W1.weight.zero_()
        head.W1.weight[:, 0] = 1.0
        head.W2.weight.zero_()
        head.W2.weight[support, 0] = 3.0
    rt = Runtime(target5, max_len=32, batch_size=64)
    firsts, seconds, accepted = [], [], 0
    for seed in range(25):
        srcs = [DSparkSource(head, "dspark", seed=seed * 64 + i) for i in range(64)]
        g = rt.generate([prompt] * 64, 2, source=srcs, sampling=sampling, k=3, seed=seed, ignore_eos=True)
        firsts += [t[0] for t in g.tokens]
        seconds += [t[1] for t in g.tokens]
        accepted += g.stats.accepted[0]
    emp1 = torch.bincount(torch.tensor(firsts), minlength=259).float() / len(firsts)
    assert 0.5 * (emp1 - p1).abs().sum() < 0.06
    x1 = int(support[0])
    p2 = sampling.probs(target5(torch.tensor([prompt + [x1]])).logits[0, -1])
    after = torch.tensor([s for f, s in zip(firsts, seconds) if f == x1])
    emp2 = torch.bincount(after, minlength=259).float() / after.numel()
    assert after.numel() > 200 and 0.5 * (emp2 - p2).abs().sum() < 0.12
    assert accepted > 400  # the rule was exercised: many first drafts were accepted (with q != p)


@pytest.mark.parametrize("family", ["dspark", "dflash"])
def test_training_lowers_loss_rl_runs_and_checkpoint_round_trips(peaked_target, tmp_path, family):  # noqa: F811
    from train.trainer import train_draft

    feats = tiny_features(peaked_target)
    cfg = make_cfg(tmp_path, stages=["soft_label", "rl"], rl_steps=3, loss="tv", distill_weight=0.9,
                   anchors_per_sequence=8)
    cfg.draft.family, cfg.draft.k = family, K
    cfg.draft.extra = {"rank": 16} if family == "dspark" else {}
    head_dir = train_draft(cfg, peaked_target, feats, tmp_path)
    curve = losses(tmp_path / "metrics.jsonl")
    first, last = sum(curve[s] for s in range(1, 6)) / 5, sum(curve[s] for s in range(16, 21)) / 5
    assert last < 0.9 * first, (first, last)  # measured: dspark 2.18 -> 1.74, dflash 2.21 -> 1.57
    rl = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r["stage"] == "rl"]
    assert rl[-1]["step"] == 3 and 0 <= rl[-1]["expected_accepted"] <= K
    # save / load round trip: identical drafts and confidences
    head = load_draft(head_dir, peaked_target)
    assert head.family_name == family and (head.rank > 0) == (family == "dspark")
    item = feats[0]
    ids, aux = item["input_ids"][:20], item["aux_hidden"][:19]
    again = load_draft(head_dir, peaked_target)
    a, b = head.draft(ids, aux, DraftCache(), K), again.draft(ids, aux, DraftCache(), K)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # a target with other feature layers is refused
    model, tok = tiny_random_llama(num_layers=6, seed=1)
    with pytest.raises(DraftheadsError, match="layer_ids"):
        load_draft(head_dir, Target(model, tok, "tiny-random-llama", layer_ids=(1, 2)))


def test_bad_extra_is_a_clear_error(target5):
    from models.checkpoint import build_draft

    with pytest.raises(DraftheadsError, match="sequential"):
        build_draft("dspark", target5, K, extra={"sequential": "lstm"})
    with pytest.raises(DraftheadsError, match="draft.extra.rnak is not an option of draft.family=dspark"):
        build_draft("dspark", target5, K, extra={"rnak": 8})


@pytest.mark.parametrize("coupled", [False, True])
def test_the_confidence_loss_reaches_the_backbone_only_when_coupled(target5, coupled):
    from models.checkpoint import build_draft

    head = build_draft("dspark", target5, K, extra={"rank": 8, "confidence_grad": coupled})
    hidden = torch.randn(3, head.hidden_size + 8, requires_grad=True)
    head.confidence_logit(hidden, torch.tensor([1, 2, 3])).sum().backward()
    assert (hidden.grad is not None and bool(hidden.grad.abs().sum() > 0)) == coupled
    assert head.config["confidence_grad"] == coupled  # recorded: a reloaded head trains the same way


def test_sequential_temperature_scaling_lowers_ece():
    from train.calibration import ece, fit_sequential_temperature

    g = torch.Generator().manual_seed(0)
    true = torch.randn(4000, K, generator=g) * 1.5 + 1.0  # true survival logits
    accepted = (torch.rand(4000, K, generator=g) < torch.sigmoid(true)).float()
    z = true * 3.0  # an overconfident head
    tau, report = fit_sequential_temperature(z, accepted)
    assert all(a <= b for a, b in zip(report["ece_after"], report["ece_before"])), report
    assert report["ece_before"][0] > 0.05 and report["ece_after"][0] < 0.03, report
    assert 2.0 < float(tau[0]) < 4.5  # recovers the factor 3
    assert ece(torch.tensor([0.9, 0.1]), torch.tensor([1.0, 0.0])) == pytest.approx(0.1)


def test_calibrate_sets_position_temperatures(target5):
    from train.calibration import calibrate

    head = make_head(target5)
    feats = [{"input_ids": f["input_ids"][0], "loss_mask": torch.ones(20, dtype=torch.bool),
              "aux_hidden": f["aux_hidden"][0], "final_hidden": f["final_hidden"][0]}
             for f in (features(target5, seed=s) for s in range(3))]
    report = calibrate(head, target5, feats, temperature=1.0, anchors=8)
    assert report["blocks"] > 10 and len(report["tau"]) == K
    assert report["ece_after"][0] <= report["ece_before"][0]
    assert torch.equal(head.confidence_temperature, torch.tensor(report["tau"]).to(head.confidence_temperature)) or \
        torch.allclose(head.confidence_temperature, torch.tensor(report["tau"]), atol=1e-4)


def test_embedded_round_trip_and_errors(target5, tmp_path):
    from models.embedded import embed_draft, load_embedded

    head = make_head(target5)
    with torch.no_grad():
        head.confidence_temperature.fill_(2.0)
    out = embed_draft(target5, head, tmp_path / "emb")
    config = json.loads((out / "config.json").read_text())
    assert config["draft_head"]["family"] == "dspark"
    from safetensors import safe_open

    with safe_open(str(out / "draft.safetensors"), framework="pt") as st:
        keys = list(st.keys())
    assert {k for k in keys if k.startswith("draft.")} == {"draft." + k for k in head.state_dict()}
    assert "draft.W1.weight" in keys and not any(k.startswith("draft.") and ("embed_tokens" in k or "lm_head" in k)
                                                 for k in keys)  # embedding / LM head shared, not duplicated
    target, loaded = load_embedded(out)
    batch = features(target5, T=14)
    ids, aux = batch["input_ids"][0], batch["aux_hidden"][0, :13]
    from inference.sources.base import DraftContext
    from inference.sources.dspark import DSparkSource

    alone = DSparkSource(head, "alone").propose(DraftContext(ids, aux), K, SamplingConfig())
    embedded = DSparkSource(loaded, "embedded").propose(DraftContext(ids, target(ids[None]).aux_hidden[0, :13]), K,
                                                         SamplingConfig())
    assert torch.equal(alone.tokens, embedded.tokens)
    torch.testing.assert_close(alone.confidences, embedded.confidences)  # calibration temperatures travel too
    plain, none = load_embedded(out, enable_draft_head=False)
    assert none is None and plain.layer_ids == target5.layer_ids
    # missing weights: a plain target directory
    target5.model.save_pretrained(tmp_path / "plain")
    target5.tokenizer.save_pretrained(tmp_path / "plain")
    with pytest.raises(DraftheadsError, match="no embedded draft head"):
        load_embedded(tmp_path / "plain")
    # missing weights: config records a head, the tensors are gone
    (out / "draft.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(DraftheadsError, match="draft.safetensors' is missing"):
        load_embedded(out)
    (tmp_path / "moved.safetensors").rename(out / "draft.safetensors")
    # a draft_head entry recorded for another target
    config["draft_head"]["fingerprint"]["tokenizer_hash"] = "0" * 16
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftheadsError, match=str(out)):
        load_embedded(out)


def test_calibration_fits_on_the_split_the_head_never_trained_on(tmp_path):
    """--holdout defaults to the run's train.holdout_sequences (its resolved config); a head that held none out is
    refused rather than calibrated on the sequences it trained on."""
    from omegaconf import OmegaConf

    from models.errors import DraftheadsError
    from train.calibration import held_out_count

    OmegaConf.save(OmegaConf.create({"train": {"holdout_sequences": 48}}), tmp_path / "resolved_config.yaml")
    assert held_out_count(tmp_path) == 48
    OmegaConf.save(OmegaConf.create({"train": {"holdout_sequences": 0}}), tmp_path / "resolved_config.yaml")
    with pytest.raises(DraftheadsError, match="records no held-out sequences .* Pass --holdout N"):
        held_out_count(tmp_path)



def test_embedding_into_another_target_is_refused(target5, tmp_path):
    """The head's recorded target (layer ids 1-5) against a destination reading layers 0-4, and a head of another
    feature width without a record: both named, nothing written."""
    from models.checkpoint import read_draft_config, save_draft
    from models.embedded import embed_draft
    from models.errors import DraftheadsError
    from models.target import Target

    head = make_head(target5)
    save_draft(head, tmp_path / "head", target5)
    other = Target(target5.model, target5.tokenizer, "tiny-random-llama", layer_ids=(0, 1, 2, 3, 4))
    with pytest.raises(DraftheadsError, match=r"layer_ids: \[1, 2, 3, 4, 5\] there, \[0, 1, 2, 3, 4\] here"):
        embed_draft(other, head, tmp_path / "a", built_for=read_draft_config(tmp_path / "head")["target"])
    three = Target(target5.model, target5.tokenizer, "tiny-random-llama", layer_ids=(1, 2, 3))
    with pytest.raises(DraftheadsError, match="num_aux_layers: 5 in the head, 3 here"):
        embed_draft(three, head, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
