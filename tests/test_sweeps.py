"""Sweeps users can trust: each point of a Hydra multirun in its own directory, the data prepared once, W&B runs
carrying the final τ, a ranked summary with readable figures, and every point of the shipped sweep composes."""

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["data.max_records=8", "train.steps=4", "eval.limit=2", "eval.max_new=8", "eval.k=[3]", "eval.head_tree=false",
         "runtime.threads=1"]


def _distill(*args, env=None):
    return subprocess.run([sys.executable, "-m", "train.distill", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def multirun(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    r = _distill("-m", "+experiment=smoke", "train.temperature.start=1.0,2.0", *SMALL, f"hydra.sweep.dir={root}")
    assert r.returncode == 0, r.stderr[-3000:]
    return root, r.stdout


def test_each_point_has_its_own_run_and_the_data_is_prepared_once(multirun):
    root, stdout = multirun
    points = [root / "0", root / "1"]
    starts = [yaml.safe_load((p / "resolved_config.yaml").read_text())["train"]["temperature"]["start"] for p in points]
    assert starts == [1.0, 2.0]
    assert stdout.count("[draftheads] data: ready in") == 1  # the second point reuses the first one's data
    assert (points[0] / "data").resolve() == (points[1] / "data").resolve()
    shared = sorted([(points[0] / "data").resolve().name, "regenerated", ".lock"])  # one data dir, one text, the lock
    assert sorted(p.name for p in (root / "data").iterdir()) == shared
    assert len(list((root / "data" / "regenerated").glob("*.jsonl"))) == 1
    heads = [(p / "head" / "model.safetensors").read_bytes() for p in points]
    assert heads[0] != heads[1]  # a changed setting is never served by a stale stage
    for p, start in zip(points, starts):
        assert json.loads((p / "head_soft_label" / "settings.json").read_text())["train.temperature"]["start"] == start
        assert (p / "eval" / "summary_mt_bench.png").stat().st_size > 10_000


def test_the_summary_ranks_the_points_and_draws_them(multirun):
    root, _ = multirun
    r = subprocess.run([sys.executable, "-m", "eval.sweep_summary", str(root)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert [p["label"] for p in result["points"]] in (["start=1.0", "start=2.0"], ["start=2.0", "start=1.0"])
    taus = [p["tau"] for p in result["points"]]
    assert taus == sorted(taus, reverse=True) and all(t >= 1.0 for t in taus)
    assert len(result["figures"]) == 3 and all(Path(f).stat().st_size > 10_000 for f in result["figures"])
    assert "| rank | label |" in (root / "sweep_summary.md").read_text()


def test_points_without_a_tau_table_rank_by_the_kept_heads_chain(tmp_path):
    from eval.sweep_summary import collect

    def point(name, lr, tau=None, kept_chain=None, last_chain=None):
        run = tmp_path / name
        (run / "head_soft_label").mkdir(parents=True)
        (run / "resolved_config.yaml").write_text(yaml.safe_dump({"train": {"lr": lr}}))
        (run / "run_report.json").write_text(json.dumps({"eval": [{"source": "head", "tau": tau, "k": 5,
                                                                   "acceptance": "0.5"}] if tau else []}))
        (run / "metrics.jsonl").write_text(json.dumps({"stage": "soft_label", "step": 10, "val_loss": 1.0,
                                                       "val_tau_chain": last_chain}) + "\n")
        if kept_chain is not None:
            (run / "head_soft_label" / "metrics.json").write_text(json.dumps({"best_val_tau_chain": kept_chain}))

    point("a", 1e-3, kept_chain=1.30, last_chain=1.25)  # the kept step's chain, not the last validation's
    point("b", 2e-3, tau=1.40)
    point("c", 3e-3, kept_chain=1.35)
    point("d", 4e-3)
    point("e", 5e-3, tau=1.50)
    points = collect(tmp_path)
    assert [p["label"] for p in points] == ["lr=0.005", "lr=0.002", "lr=0.003", "lr=0.001", "lr=0.004"]
    assert [p["val_tau_chain"] for p in points[2:]] == [1.35, 1.30, None]


def test_a_wandb_offline_run_holds_the_final_tau(tmp_path):
    pytest.importorskip("wandb")
    r = _distill("+experiment=smoke", f"output_dir={tmp_path}", "train.wandb=true", *SMALL,
                 env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert r.returncode == 0, r.stderr[-3000:]
    tau = next(row["tau"] for row in json.loads((tmp_path / "run_report.json").read_text())["eval"]
               if row["source"] == "head")
    data = next((tmp_path / "wandb").rglob("*.wandb")).read_bytes()  # the offline run's record log
    assert re.search(rb"tau/mt_bench/head_k3_T0.{1,6}" + re.escape(repr(float(tau)).encode()), data)
    assert b"soft_label/val_tau_est" in data or b"soft_label/loss" in data


def test_every_point_of_the_shipped_sweep_composes_and_passes_the_checks():
    from hydra import compose, initialize_config_dir

    from conf.schema import check_config, register_configs

    sweep = yaml.safe_load((ROOT / "conf" / "sweep" / "temperature_wandb.yaml").read_text())
    names = list(sweep["parameters"])
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        multirun_grid = compose("config", overrides=["+experiment=temperature_sweep"],
                                return_hydra_config=True).hydra.sweeper.params
        for values in itertools.product(*(sweep["parameters"][n]["values"] for n in names)):
            cfg = compose("config", overrides=["+experiment=temperature_sweep",
                                               *(f"{n}={v}" for n, v in zip(names, values))])
            check_config(cfg)
    for name, spec in multirun_grid.items():  # the Hydra multirun runs the same grid
        assert [float(v) if v[0].isdigit() else v for v in spec.split(",")] == sweep["parameters"][name]["values"]
