"""Hostile inputs to the evaluation commands (issue: nothing silently wrong): every bad number is one readable line
and exit status 2, before any model is loaded."""

import pytest

from eval import acceptance, speedup

PROMPTS = "eval/data/spec_bench_dev.jsonl"


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "-1"], "--temperature=-1.0 must be >= 0"),
    (["--temperature", "inf"], "--temperature=inf must be >= 0"),
    (["--temperature", "nan"], "--temperature=nan must be >= 0"),
    (["--top-p", "2"], "--top-p=2.0 must be in [1e-09, 1]"),
    (["--top-p", "0"], "--top-p=0.0 must be in [1e-09, 1]"),
    (["--top-k", "-5"], "--top-k=-5 must be >= 0"),
    (["--limit", "-1"], "--limit=-1 must be >= 1"),
    (["--k", "0"], "--k=0 must be in [1, 64]"),
    (["--threads", "0"], "--threads=0 must be in [1, 1024]"),
    (["--max-new", "0"], "--max-new=0 must be >= 1"),
])
def test_acceptance_refuses_bad_numbers(flags, message, tmp_path, capsys):
    code = acceptance.main(["--prompts", PROMPTS, "--source", "prompt_lookup", "--out", str(tmp_path / "o.json"),
                            *flags])
    assert code == 2 and capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("flags,message", [
    (["--k", "0"], "--k=0 must be in [1, 64]"), (["--batch", "0"], "--batch=0 must be >= 1"),
    (["--repeats", "0"], "--repeats=0 must be >= 1"), (["--max-new", "0"], "--max-new=0 must be >= 1"),
    (["--temperature", "nan"], "--temperature=nan must be >= 0"), (["--limit", "-1"], "--limit=-1 must be >= 1"),
])
def test_speedup_refuses_bad_numbers(flags, message, capsys):
    assert speedup.main(["--prompts", PROMPTS, *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]


def test_categories_are_read_the_same_way_by_both_benchmarks():
    assert acceptance.parse_categories(" writing, coding ,") == ["writing", "coding"]
    assert acceptance.parse_categories("") is None and acceptance.parse_categories(None) is None


def test_one_sampling_config_refuses_what_it_cannot_sample():
    from inference.sampling import SamplingConfig
    from models.errors import DraftheadsError

    for bad in (dict(temperature=-1.0), dict(temperature=float("inf")), dict(top_p=0.0), dict(top_p=1.5),
                dict(top_k=-1)):
        with pytest.raises(DraftheadsError):
            SamplingConfig(**bad)
