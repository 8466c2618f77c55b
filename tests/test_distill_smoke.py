"""The real entry point end to end on the tiny target (lightning-hydra-template's fast_dev_run)."""

import json
import subprocess
import sys
from pathlib import Path

from inference.host_memory import mimalloc_library

ROOT = Path(__file__).resolve().parents[1]


def _run(out, *extra):
    return subprocess.run([sys.executable, "-m", "train.distill", "+experiment=smoke", f"output_dir={out}",
                           "runtime.threads=1", "data.max_records=8", "train.steps=6", "train.checkpoint_every=3",
                           "eval.limit=2", "eval.max_new=8", *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_smoke_experiment_runs_end_to_end_and_resumes(tmp_path):
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "run_report.json").read_text())
    assert report["data"]["features"]["tokens"] > 0 and (tmp_path / "head" / "config.json").is_file()
    assert [row["source"] for row in report["eval"]] == ["head", "head[tree=1]", "prompt_lookup"]  # the head first
    assert all(1.0 <= row["tau"] <= 5.0 for row in report["eval"])
    assert report["malloc"].startswith("mimalloc" if mimalloc_library() else "freed blocks")  # re-executed under it
    regenerated = (tmp_path / "data" / "regenerated.jsonl").read_text()
    rows = {p: p.read_bytes() for p in (tmp_path / "eval").glob("*/*.json")}
    assert len(rows) == 3
    sim = subprocess.run([sys.executable, "-m", "eval.chain_simulation", str(tmp_path), "--holdout", "3", "--k", "4",
                          "--max-new", "8", "--threads", "1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert sim.returncode == 0, sim.stderr[-2000:]
    result = json.loads(sim.stdout.strip().splitlines()[-1])  # the greedy chain on the run's own sequences
    assert result["rounds"] > 0 and 1.0 <= result["tau"] <= 5.0 and result["sequences"] == 3

    again = _run(tmp_path)  # everything is on disk with the same settings: the data stage is skipped ...
    assert again.returncode == 0, again.stderr[-2000:]
    assert "[draftheads] data: ready in" in again.stdout
    assert again.stdout.count("measured before") == 3  # ... and so is every τ row (same request, same head files)
    assert {p: p.read_bytes() for p in rows} == rows
    assert (tmp_path / "data" / "regenerated.jsonl").read_text() == regenerated
    more = _run(tmp_path, "data.max_records=10")  # a setting that shapes the data: the stage runs and extends ...
    assert more.returncode == 2 and "Traceback" not in more.stderr  # ... and the stage-1 head no longer matches it
    assert "stage-1 head" in more.stderr and "other settings (data: '6 sequences" in more.stderr, more.stderr[-2000:]
    more = _run(tmp_path, "data.max_records=10", "train.resume=false")
    assert more.returncode == 0, more.stderr[-2000:]
    report3 = json.loads((tmp_path / "run_report.json").read_text())
    assert more.stdout.count("measured before") == 1 and "prompt_lookup k=4 T=0: measured before" in more.stdout
    assert report3["data"]["conversations"] == 10 and report3["data"]["features"]["new_tokens"] > 0
    assert (tmp_path / "data" / "regenerated.jsonl").read_text().startswith(regenerated)
    fewer = _run(tmp_path, "data.max_records=8")  # lowered: never served by the 10-record features in silence
    assert fewer.returncode == 2 and "Traceback" not in fewer.stderr
    assert "holds features of" in fewer.stderr.strip().splitlines()[-1], fewer.stderr[-2000:]
