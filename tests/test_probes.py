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


# ------------------------------------------------------------------------------------------------------------------
# damaged heads, run directories and inputs: one readable line, exit status 2, nothing lost
# ------------------------------------------------------------------------------------------------------------------
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUN = ["+experiment=smoke", "data.max_records=8", "train.checkpoint_every=2", "eval.limit=0", "runtime.threads=1"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("base")
    r = subprocess.run([sys.executable, "-m", "train.distill", *RUN, "train.steps=4", f"output_dir={out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def _cut(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def _no_heads(d: Path) -> None:  # training reruns from the checkpoints (train.steps is raised to 6)
    shutil.rmtree(d / "head")
    shutil.rmtree(d / "head_soft_label")


HEAD_DAMAGE = {
    "config truncated": (lambda d: _cut(d / "head" / "config.json"), "config.json' is not valid JSON"),
    "config empty": (lambda d: _cut(d / "head" / "config.json", 0), "config.json' is not valid JSON"),
    "config without target": (lambda d: (d / "head" / "config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "head" / "config.json").read_text()).items() if k != "target"})),
        "lacks ['target']"),
    "weights truncated": (lambda d: _cut(d / "head" / "model.safetensors"), "model.safetensors' cannot be read"),
    "weights empty": (lambda d: _cut(d / "head" / "model.safetensors", 0), "model.safetensors' cannot be read"),
    "weights garbage": (lambda d: (d / "head" / "model.safetensors").write_bytes(os.urandom(5000)), "cannot be read"),
    "a file, not a directory": (lambda d: (shutil.rmtree(d / "head"), (d / "head").write_text("x")),
                                "is not a draft checkpoint"),
}
RUN_DAMAGE = {
    "checkpoint weights truncated": (lambda d: _cut(d / "checkpoints" / "step_4" / "model.safetensors"),
                                     "checkpoints/step_4' cannot be read"),
    "optimizer truncated": (lambda d: _cut(d / "checkpoints" / "step_4" / "optimizer.bin"),
                            "checkpoints/step_4' cannot be read"),
    "feature manifest damaged": (lambda d: _cut(d / "data" / "features" / "manifest.json"), "manifest.json' is damaged"),
    "feature shard missing": (lambda d: (d / "data" / "features" / "shard_00000.safetensors").unlink(),
                              "shard_00000.safetensors' cannot be read"),
    "feature shard damaged": (lambda d: _cut(d / "data" / "features" / "shard_00000.safetensors"),
                              "shard_00000.safetensors' cannot be read"),
    "record without id": (lambda d: (d / "data" / "regenerated.jsonl").write_text(
        (d / "data" / "regenerated.jsonl").read_text().replace('"id": 0,', "", 1)), "is not a regenerated record"),
}
RECOVERS = {  # damage a rerun repairs by itself, resuming to the same head
    "empty checkpoint marker": lambda d: _cut(d / "checkpoints" / "step_4" / "trainer_state.json", 0),
    "torn metrics line": lambda d: _cut(d / "metrics.jsonl", len((d / "metrics.jsonl").read_bytes()) - 7),
    "damaged data report": lambda d: _cut(d / "data" / "data_report.json"),
}


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
    _no_heads(d)
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
