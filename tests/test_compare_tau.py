"""eval.compare_tau: the τ difference of two acceptance runs, its bootstrap interval, and mismatched runs refused."""

import json

import pytest

from eval.compare_tau import main, tau_difference
from models.errors import DraftheadsError


def write(path, counts):
    turns = [{"question_id": q, "turn": t, "tokens": tok, "rounds": r} for (q, t), (tok, r) in counts.items()]
    path.write_text(json.dumps({"turns": turns}))
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


def test_mismatched_runs_are_refused(tmp_path, capsys):
    before = write(tmp_path / "b.json", {(1, 0): (60, 50)})
    after = write(tmp_path / "a.json", {(2, 0): (60, 40)})
    with pytest.raises(DraftheadsError, match="cover different prompts/turns"):
        tau_difference([(before, after)])
    assert main([before]) == 2 and "BEFORE AFTER pairs" in capsys.readouterr().err
    assert main([before, str(tmp_path / "missing.json")]) == 2
    assert "not an eval.acceptance results JSON" in capsys.readouterr().err
