"""data.features=online: the target computes hidden states inside the training step; nothing but tokens on disk, and
the same curve, head and τ as offline features (online rounds hidden states exactly as storage does)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path, mode: str, *extra):
    r = subprocess.run([sys.executable, "-m", "train.distill", "+experiment=smoke", f"output_dir={out}",
                        f"data.features={mode}", "data.max_records=12", "train.steps=8", "train.log_every=1",
                        "eval.limit=2", "eval.max_new=8", "eval.k=[3]", "eval.head_tree=false", "runtime.threads=1",
                        *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "run_report.json").read_text())


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_online_trains_exactly_as_offline_with_tokens_only_on_disk(tmp_path, dtype):
    off = _run(tmp_path / "off", "offline", f"data.feature_dtype={dtype}")
    on = _run(tmp_path / "on", "online", f"data.feature_dtype={dtype}")
    a = [json.loads(x) for x in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b):  # measured: equal to the printed 6 digits
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), (ra, rb)
    wa, wb = (load_file(tmp_path / run / "head" / "model.safetensors") for run in ("off", "on"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5)
    assert [r["tau"] for r in on["eval"]] == [r["tau"] for r in off["eval"]]
    per_token = {run["data"]["features"]["bytes_per_token"] for run in (off, on)}
    assert min(per_token) < 12 < 100 < max(per_token)  # online: ids + masks (+ shard header); offline: hidden states
    sim = subprocess.run([sys.executable, "-m", "eval.chain_simulation", str(tmp_path / "on"), "--holdout", "2",
                          "--k", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert sim.returncode != 0 and "Traceback" not in sim.stderr, sim.stderr[-2000:]
    assert "holds tokens only (a data.features=online run); the chain simulation reads stored hidden states" in sim.stderr
