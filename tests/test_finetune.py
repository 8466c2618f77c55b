"""Domain fine-tuning as a first-class run: start from a head, train on domain prompts the target answers with a
replayed share of the general data, and end with one before/after table on domain and general prompts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.checkpoint import load_draft, save_draft
from models.draft_vocab import DraftVocab, extend_draft_vocab
from models.peagle import peagle_for_target

ROOT = Path(__file__).resolve().parents[1]


def _distill(out, *extra):
    r = subprocess.run([sys.executable, "-m", "train.distill", "+experiment=smoke", f"output_dir={out}",
                        "runtime.threads=1", "train.steps=6", "eval.max_new=8", "eval.k=[3]", "eval.head_tree=false",
                        *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "run_report.json").read_text()), r.stdout


def test_a_fine_tune_ends_with_one_before_after_table(tmp_path):
    _distill(tmp_path / "general", "data.max_records=10", "eval.limit=0")
    prompts = tmp_path / "code.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"def f{i}(x): return x + {i}  # explain"]}) + "\n"
                               for i in range(8)))
    report, stdout = _distill(tmp_path / "ft", "data.source=prompt_jsonl", f"data.path={prompts}", "data.max_records=8",
                              f"draft.init_from={tmp_path}/general/head", "eval.limit=2",
                              f"train.replay_features={tmp_path}/general/data/features", "train.replay_fraction=0.25",
                              "eval.domain_prompts=humaneval", "eval.domain_skip=150", "eval.domain_limit=2")
    assert "replay: 3 of" in stdout and "mixed into 8 domain ones" in stdout  # 3 / (8 + 3) ~ 0.25
    rows = [r for r in report["eval"] if "tau" in r]
    assert {(r["prompts"], r["source"]) for r in rows} == {(p, s) for p in ("mt_bench", "humaneval")
                                                           for s in ("prompt_lookup", "head_before", "head")}
    changes = [r["change"] for r in report["eval"] if "change" in r]
    assert [c["prompts"] for c in changes] == ["mt_bench", "humaneval"]
    for c in changes:
        assert c["ci95"][0] <= c["diff"] <= c["ci95"][1] and c["questions"] == 2
    files = sorted(p.relative_to(tmp_path / "ft" / "eval").as_posix() for p in (tmp_path / "ft" / "eval").rglob("*.json"))
    assert "humaneval/head_before_k3_T0.json" in files and "mt_bench/head_k3_T0.json" in files
    summary = (tmp_path / "ft" / "eval" / "summary.md").read_text()
    assert "| acceptance | tested |" in summary  # each acceptance figure beside the rounds it rests on
    assert all(len(r["tested"].split()) == len(r["acceptance"].split()) for r in rows)
    assert "Before / after fine-tuning" in summary and (tmp_path / "ft" / "eval" / "summary_humaneval.png").is_file()


def test_extending_the_draft_vocabulary_keeps_old_rows_and_takes_new_ones_from_the_target(tiny_target, tmp_path):
    head = peagle_for_target(tiny_target, k=3, draft_vocab=DraftVocab(torch.arange(0, 120, 2), tiny_target.vocab_size))
    with torch.no_grad():
        head.lm_head.weight.mul_(3.0)  # "trained": no longer the target's rows
    old_rows = {int(t): head.lm_head.weight[i].clone() for i, t in enumerate(head.draft_ids)}
    counts = torch.zeros(tiny_target.vocab_size, dtype=torch.long)
    counts[[7, 9, 11, 4]] = torch.tensor([50, 40, 30, 100])  # 4 is already drafted
    assert extend_draft_vocab(head, tiny_target, counts, 2) == 2
    ids = head.draft_ids.tolist()
    assert 7 in ids and 9 in ids and 11 not in ids and len(ids) == 62 and ids == sorted(ids)
    lm = tiny_target.model.get_output_embeddings().weight
    for i, t in enumerate(ids):
        expected = old_rows[t] if t in old_rows else lm[t]
        assert torch.equal(head.lm_head.weight[i], expected), t
    assert int(head.t2d.sum()) == 62 and torch.equal(torch.arange(62) + head.d2t, head.draft_ids)
    save_draft(head, tmp_path / "h", tiny_target)
    again = load_draft(tmp_path / "h", tiny_target)
    assert again.config["draft_vocab_size"] == 62 and torch.equal(again.draft_ids, head.draft_ids)


def test_replay_features_of_another_target_are_refused(tiny_target, tmp_path):
    """Replayed hidden states must be this target's: another model's name, or the data report's other weights (a
    fine-tuned checkpoint at target.path), is an error naming both; this target's are mixed in."""
    from data.features import extract_features
    from data.prepare import weights_identity
    from models.errors import DraftheadsError
    from models.target import Target
    from tests.test_trainer import tiny_features
    from train.trainer import with_replay

    seqs = [(torch.arange(3, 30), torch.arange(27) > 3) for _ in range(4)]
    extract_features(tiny_target, seqs, tmp_path / "mine" / "features")
    other = Target(tiny_target.model, tiny_target.tokenizer, "some-other-model", tiny_target.layer_ids)
    extract_features(other, seqs, tmp_path / "theirs" / "features")
    domain = tiny_features(tiny_target, n=3)
    assert len(with_replay(domain, str(tmp_path / "mine" / "features"), 0.5, tiny_target, {})) == 6
    with pytest.raises(DraftheadsError, match="holds hidden states of target 'some-other-model'"):
        with_replay(domain, str(tmp_path / "theirs" / "features"), 0.5, tiny_target, {})
    tuned = weights_identity(str(tmp_path / "my-finetuned-target"), "float32")
    (tmp_path / "mine" / "data_report.json").write_text(json.dumps({"settings": {"target": {"name": "x"}}}))
    with pytest.raises(DraftheadsError, match="not of this run's 'tiny-random-llama' \\({'path'"):
        with_replay(domain, str(tmp_path / "mine" / "features"), 0.5, tiny_target, tuned)
    for spelled, now in (("fp32", {}), ("bf16", weights_identity(None, "bfloat16"))):  # reports of older runs
        report = {"settings": {"target": {"name": "x", "weights": {"dtype": spelled}}}}
        (tmp_path / "mine" / "data_report.json").write_text(json.dumps(report))
        assert len(with_replay(domain, str(tmp_path / "mine" / "features"), 0.5, tiny_target, now)) == 6


def test_replay_needs_its_features(tiny_target):
    from models.errors import DraftheadsError
    from train.trainer import with_replay

    with pytest.raises(DraftheadsError, match="train.replay_fraction=0.2 needs train.replay_features=DIR"):
        with_replay([{"aux_hidden": 1}], None, 0.2, tiny_target)


def test_a_start_head_of_another_shape_is_refused_by_name(tiny_target, tmp_path):
    """draft.init_from with the run's draft.k / family / num_layers set otherwise: the loss would train depths the
    head lacks (or record a K it was not trained at); the error names each option and the head's value."""
    from models.errors import DraftheadsError
    from tests.test_trainer import make_cfg, tiny_features
    from train.trainer import check_start, train_draft

    save_draft(peagle_for_target(tiny_target, k=3, parallel=False), tmp_path / "start", tiny_target)  # eagle3
    cfg = make_cfg(tmp_path / "run", steps=2)
    cfg.draft.init_from, cfg.draft.k, cfg.draft.parallel = str(tmp_path / "start"), 5, True
    with pytest.raises(DraftheadsError, match=r"draft.parallel=True \(the head's: False\), draft.k=5 \(the head's: "
                                              r"3\); set those to the head's"):
        train_draft(cfg, tiny_target, tiny_features(tiny_target), tmp_path / "run")
    cfg.draft.k, cfg.draft.parallel = 3, False  # family=peagle, parallel=false: the eagle3 head it is
    assert check_start(load_draft(tmp_path / "start", tiny_target), cfg.draft, "start").family_name == "eagle3"
    cfg.draft.init_from, cfg.draft.vocab_extend = None, 8
    with pytest.raises(DraftheadsError, match="draft.vocab_extend=8 extends an existing head's draft vocabulary"):
        train_draft(cfg, tiny_target, tiny_features(tiny_target), tmp_path / "run")


def test_a_start_head_retrained_in_place_is_another_start(tiny_target, tmp_path):
    """The fine-tune records its start head by content: retraining that head in place makes the finished fine-tune
    stale, which the rerun names instead of reporting it done."""
    from models.errors import DraftheadsError
    from tests.test_trainer import make_cfg, tiny_features
    from train.trainer import train_draft

    torch.manual_seed(0)
    save_draft(peagle_for_target(tiny_target, k=3), tmp_path / "start", tiny_target)
    cfg = make_cfg(tmp_path / "run", steps=2)
    cfg.draft.init_from = str(tmp_path / "start")
    train_draft(cfg, tiny_target, tiny_features(tiny_target), tmp_path / "run")
    train_draft(cfg, tiny_target, tiny_features(tiny_target), tmp_path / "run")  # unchanged: done
    save_draft(peagle_for_target(tiny_target, k=3), tmp_path / "start", tiny_target)  # other weights, same path
    with pytest.raises(DraftheadsError, match="came from other settings \\(start_weights: "):
        train_draft(cfg, tiny_target, tiny_features(tiny_target), tmp_path / "run")
