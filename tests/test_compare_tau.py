"""eval.compare_tau: the τ difference of two acceptance runs, its bootstrap interval, and mismatched runs refused."""

import json

import pytest

from eval.compare_tau import main, tau_difference
from models.errors import DraftheadsError


def write(path, counts, categories=None, request=None):
    turns = [{"question_id": q, "turn": t, "tokens": tok, "rounds": r, **({"category": categories[q]} if categories
                                                                          else {})}
             for (q, t), (tok, r) in counts.items()]
    path.write_text(json.dumps({"turns": turns, **({"request": request} if request else {})}))
    return str(path)


def test_difference_and_interval(tmp_path, capsys):
    before = write(tmp_path / "b.json", {(1, 0): (60, 50), (1, 1): (60, 40), (2, 0): (30, 30), (3, 0): (64, 40)})
    after = write(tmp_path / "a.json", {(1, 0): (60, 40), (1, 1): (60, 40), (2, 0): (30, 25), (3, 0): (64, 32)})
    out = tau_difference([(before, after)])
    assert out["tau_before"] == round(214 / 160, 4) and out["tau_after"] == round(214 / 137, 4)
    assert out["diff"] == pytest.approx(214 / 137 - 214 / 160, abs=1e-4) and out["questions"] == 3
    lo, hi = out["ci95"]
    assert 0 < lo <= out["diff"] <= hi  # every question got faster: no resample can show a loss
    assert main([before, after, before, after]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and json.loads(lines[-1])["pairs"] == 2 and json.loads(lines[-1])["turns"] == 8


def test_by_category_each_category_on_its_own_questions(tmp_path, capsys):
    cats = {1: "math", 2: "coding", 3: "math"}
    before = write(tmp_path / "b.json", {(1, 0): (60, 50), (2, 0): (30, 30), (3, 0): (64, 40)}, cats)
    after = write(tmp_path / "a.json", {(1, 0): (60, 40), (2, 0): (30, 15), (3, 0): (64, 40)}, cats)
    assert main([before, after, "--by-category"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x.get("category") for x in lines] == ["math", "coding", None]
    math, coding, pooled = lines
    assert math["questions"] == 2 and math["diff"] == pytest.approx(124 / 80 - 124 / 90, abs=1e-4)
    assert coding["diff"] == pytest.approx(1.0, abs=1e-4) and coding["ci95"] == [1.0, 1.0]
    assert pooled["questions"] == 3


def test_mismatched_runs_are_refused(tmp_path, capsys):
    before = write(tmp_path / "b.json", {(1, 0): (60, 50)})
    after = write(tmp_path / "a.json", {(2, 0): (60, 40)})
    with pytest.raises(DraftheadsError, match="cover different prompts/turns"):
        tau_difference([(before, after)])
    assert main([before]) == 2 and "BEFORE AFTER pairs" in capsys.readouterr().err
    assert main([before, str(tmp_path / "missing.json")]) == 2
    assert "not an eval.acceptance results JSON" in capsys.readouterr().err


def test_runs_with_other_settings_are_refused(tmp_path):
    """Same questions but another max_new (or prompts file content, temperature, seed...): the difference would
    measure the setting. Another source, K or engine is what a comparison compares."""
    counts = {(1, 0): (60, 40), (2, 0): (60, 40)}
    request = {"source": "head:a", "prompts": "p.jsonl", "files": {"p.jsonl": "abc"}, "max_new": 64, "k": 5,
               "temperature": 0.0}
    before = write(tmp_path / "b.json", counts, request=request)
    other_head = write(tmp_path / "h.json", counts, request={**request, "source": "head:b", "k": 8})
    assert tau_difference([(before, other_head)])["diff"] == 0
    for name, change in (("max_new", {"max_new": 128}), ("the prompts file's content", {"files": {"p.jsonl": "def"}})):
        after = write(tmp_path / "a.json", counts, request={**request, **change})
        with pytest.raises(DraftheadsError, match=f"were run with other settings \\({name}"):
            tau_difference([(before, after)])
    # the prompts path as typed ("./p.jsonl") is found under the key eval.acceptance writes ("p.jsonl")
    dotted = {**request, "prompts": "./p.jsonl"}
    before = write(tmp_path / "b2.json", counts, request=dotted)
    after = write(tmp_path / "a2.json", counts, request={**dotted, "files": {"p.jsonl": "def"}})
    with pytest.raises(DraftheadsError, match="the prompts file's content"):
        tau_difference([(before, after)])


def test_a_repeated_question_id_is_refused(tmp_path):
    turns = [{"question_id": 1, "turn": 0, "tokens": 60, "rounds": 40, "category": c} for c in ("math", "coding")]
    (tmp_path / "b.json").write_text(json.dumps({"turns": turns}))
    with pytest.raises(DraftheadsError, match="b.json' hold question_id 1 \\(turn 0\\) twice"):
        tau_difference([(str(tmp_path / "b.json"), str(tmp_path / "b.json"))])


def test_pooled_pairs_share_what_tau_means_and_a_run_without_settings_is_refused(tmp_path):
    """Pairs at T=0 and T=1 pooled would blend two quantities; a run that recorded no settings cannot be checked
    against one that did."""
    counts = {(1, 0): (60, 40), (2, 0): (60, 30)}
    request = {"source": "head:a", "prompts": "p.jsonl", "files": {"p.jsonl": "abc"}, "max_new": 64, "seed": 0,
               "temperature": 0.0}
    greedy = write(tmp_path / "g.json", counts, request=request)
    sampled = write(tmp_path / "s.json", counts, request={**request, "temperature": 1.0})
    other_seed = write(tmp_path / "s1.json", counts, request={**request, "seed": 1})
    assert tau_difference([(greedy, greedy), (other_seed, other_seed)])["pairs"] == 2  # draft seeds pool
    with pytest.raises(DraftheadsError, match="other settings \\(temperature: 0.0 / 1.0"):
        tau_difference([(greedy, greedy), (sampled, sampled)])
    bare = write(tmp_path / "bare.json", counts)
    with pytest.raises(DraftheadsError, match="bare.json' does not record the settings"):
        tau_difference([(greedy, bare)])
    out = tau_difference([(bare, write(tmp_path / "fast.json", {(1, 0): (60, 30), (2, 0): (60, 30)}))])
    assert out["relative"] == pytest.approx(out["diff"] / out["tau_before"], abs=1e-3)
