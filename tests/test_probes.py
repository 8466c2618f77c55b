"""Hostile inputs to the evaluation commands (issue: nothing silently wrong): every bad number is one readable line
and exit status 2, before any model is loaded."""

import json
import shutil
import subprocess
import sys

import pytest

from eval import acceptance, speedup
from eval.probe_table import HEAD_DAMAGE, PROMPTS, RECOVERS, ROOT, RUN, RUN_DAMAGE, no_heads


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "-1"], "--temperature=-1.0 must be >= 0"),
    (["--temperature", "inf"], "--temperature=inf must be >= 0"),
    (["--temperature", "nan"], "--temperature=nan must be >= 0"),
    (["--top-p", "2"], "--top-p=2.0 must be in [1e-09, 1]"),
    (["--top-p", "0"], "--top-p=0.0 must be in [1e-09, 1]"),
    (["--top-k", "-5"], "--top-k=-5 must be >= 0"),
    (["--limit", "-1"], "--limit=-1 must be >= 1"),
    (["--k", "0"], "--k=0 must be in [1, 64]"),
    (["--threads", "-1"], "--threads=-1 must be in [0, 1024]"),
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
    (["--modes", "spec", "--check-lossless"],
     "--check-lossless compares spec with plain outputs; --modes spec lacks one: add plain,spec to --modes"),
])
def test_speedup_refuses_bad_numbers(flags, message, capsys):
    assert speedup.main(["--prompts", PROMPTS, *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]


def test_the_benchmarks_run_without_hydra_or_omegaconf():
    """eval/gpu_check.sh runs them on a GPU image that may have neither: their flag checks come from conf.schema,
    which must import without them (Hydra is for train.distill's configs)."""
    import subprocess
    import sys

    code = "import sys; sys.modules['hydra'] = sys.modules['omegaconf'] = None; import eval.speedup, eval.acceptance"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]


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


# ------------------------------------------------------------------------------------------------------------------
# damaged heads, run directories and inputs: one readable line, exit status 2, nothing lost
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("base")
    r = subprocess.run([sys.executable, "-m", "train.distill", *RUN, "train.steps=4", f"output_dir={out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.parametrize("case", sorted(HEAD_DAMAGE))
def test_a_damaged_head_is_named(finished_run, tmp_path, capsys, case):
    d = tmp_path / "run"
    shutil.copytree(finished_run, d, symlinks=True)
    damage, message = HEAD_DAMAGE[case]
    damage(d)
    code = acceptance.main(["--prompts", PROMPTS, "--source", f"head:{d}/head", "--target", "tiny-random-llama",
                            "--limit", "1", "--max-new", "4", "--out", str(d / "acc.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("case", sorted(RUN_DAMAGE) + sorted(RECOVERS))
def test_a_damaged_run_directory_is_named_or_repaired(finished_run, tmp_path, case):
    d = tmp_path / "run"
    shutil.copytree(finished_run, d, symlinks=True)
    no_heads(d)
    (RUN_DAMAGE[case][0] if case in RUN_DAMAGE else RECOVERS[case])(d)
    r = subprocess.run([sys.executable, "-m", "train.distill", *RUN, "train.steps=6", f"output_dir={d}",
                        *(["data.max_records=9"] if case == "record without id" else [])], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    if case in RUN_DAMAGE:
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "Traceback" not in r.stderr and RUN_DAMAGE[case][1] in last, r.stderr[-1500:]
    else:
        assert r.returncode == 0, r.stderr[-1500:]
        steps = [json.loads(x)["step"] for x in (d / "metrics.jsonl").read_text().splitlines()]
        assert steps == sorted(set(steps)) and (d / "head" / "config.json").is_file()


def test_an_unwritable_out_is_refused_before_the_benchmark(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code = acceptance.main(["--prompts", PROMPTS, "--source", "prompt_lookup", "--target", "tiny-random-llama",
                            "--out", str(tmp_path / "file" / "a.json")])
    assert code == 2 and "cannot be written" in capsys.readouterr().err


def test_a_prompts_path_that_is_a_directory_is_named(tmp_path, capsys):
    code = acceptance.main(["--prompts", str(tmp_path), "--source", "prompt_lookup", "--out", str(tmp_path / "a.json")])
    assert code == 2 and "prompt file" in capsys.readouterr().err


def test_a_directory_as_the_data_file_is_named(tmp_path):
    from data.readers import read_conversations
    from models.errors import DraftheadsError

    with pytest.raises(DraftheadsError, match="is a directory"):
        list(read_conversations("chat_jsonl", str(tmp_path)))


def test_a_draft_file_out_under_a_file_is_refused_before_the_build(tmp_path, capsys):
    from data.draft_file_build import main

    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "x.dfl"
    code = main(["build", "--corpus", PROMPTS, "--target", "tiny-random-llama", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: --out '{out}' cannot be written (") and err.endswith("another path")
