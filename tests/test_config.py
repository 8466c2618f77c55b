"""Every experiment composes; typos and unknown names fail at compose time with Hydra's message."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conf.schema import register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
register_configs()


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_there_are_experiments():
    assert {"smoke", "peagle_smollm2", "peagle_70b"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes(name):
    cfg = _compose([f"+experiment={name}"])
    OmegaConf.to_container(cfg, resolve=False, throw_on_missing=True)
    assert cfg.name == name


def test_peagle_70b_settings():
    cfg = _compose(["+experiment=peagle_70b"])
    assert list(cfg.target.layer_ids) == [2, 40, 77] and cfg.draft.num_layers == 4
    assert cfg.accelerate.strategy == "zero3" and cfg.accelerate.num_processes == 8
    assert (CONF.parent / cfg.target.config).is_file()


@pytest.mark.parametrize("override", ["train.stepz=3", "draft.k=five", "data.nope=1"])
def test_typos_and_wrong_types_fail_at_compose(override):
    with pytest.raises(ConfigCompositionException):
        _compose(["+experiment=smoke", override])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "train.distill", *args], capture_output=True, text=True,
                          cwd=CONF.parent, timeout=120)


def test_unknown_experiment_is_one_clear_message():
    r = _cli("+experiment=smok")
    assert r.returncode != 0 and "Could not find 'experiment/smok'" in r.stderr and "Traceback" not in r.stderr


def test_missing_model_stops_before_work_without_traceback(tmp_path):
    r = _cli("+experiment=peagle_smollm2", f"target.path={tmp_path}/missing.gguf", f"output_dir={tmp_path}/out")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"error: target GGUF file '{tmp_path}/missing.gguf' does not exist; check target.path"
    assert not (tmp_path / "out" / "data").exists()
