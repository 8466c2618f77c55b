"""Every experiment composes; typos and unknown names fail at compose time with Hydra's message."""

import re
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


def test_the_two_stage_preset_keeps_the_defaults_of_the_rl_objective():
    """train=two_stage set rl_pg_weight 0.1 after the default became 0 (the extra REINFORCE term is not E[R]'s
    gradient): a preset overrides only what makes it a preset."""
    from conf.schema import TrainConfig

    train = _compose(["train=two_stage"]).train
    rl = {k: train[k] for k in ("rl_pg_weight", "rl_draw_score")}
    assert rl == {"rl_pg_weight": TrainConfig.rl_pg_weight, "rl_draw_score": TrainConfig.rl_draw_score} == \
        {"rl_pg_weight": 0.0, "rl_draw_score": True}


def test_unknown_experiment_is_one_clear_message():
    r = _cli("+experiment=smok")
    assert r.returncode != 0 and "Could not find 'experiment/smok'" in r.stderr and "Traceback" not in r.stderr


def test_missing_model_stops_before_work_without_traceback(tmp_path):
    r = _cli("+experiment=peagle_smollm2", f"target.path={tmp_path}/missing.gguf", f"output_dir={tmp_path}/out")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"error: target GGUF file '{tmp_path}/missing.gguf' does not exist; check target.path"
    assert not (tmp_path / "out" / "data").exists()


def test_every_setting_has_a_legal_range_or_set():
    from conf.schema import FREE_FORM, RULES, schema_fields

    fields = dict(schema_fields())
    assert set(RULES) <= set(fields)  # no rule for a field that no longer exists
    unchecked = [n for n, kind in fields.items() if n not in RULES and n not in FREE_FORM and kind is not bool]
    assert unchecked == []


@pytest.mark.parametrize("override,message", [
    ("draft.k=0", "draft.k=0 must be in [1, 64]"), ("draft.k=-1", "draft.k=-1 must be in [1, 64]"),
    ("train.steps=0", "train.steps=0 must be >= 1"), ("train.steps=-5", "train.steps=-5 must be >= 1"),
    ("train.grad_accum=0", "train.grad_accum=0 must be >= 1"), ("train.rl_steps=-3", "train.rl_steps=-3 must be >= 0"),
    ("train.batch_size=0", "train.batch_size=0 must be >= 1"), ("train.lr=-1", "train.lr=-1.0 must be > 0"),
    ("train.checkpoint_every=0", "must be >= 1"), ("train.log_every=0", "must be >= 1"),
    ("train.eval_every=0", "must be >= 1"), ("runtime.threads=-1", "runtime.threads=-1 must be in [0, 1024]"),
    ("data.overlong=explode", "data.overlong=explode must be one of ['truncate', 'skip']"),
    ("data.regen_max_new=0", "must be >= 1"), ("train.mixed_precision=fp8", "must be one of ['no', 'bf16', 'auto']"),
    ("train.temperature.start=0", "train.temperature.start=0.0 must be > 0"),
    ("train.temperature.end=inf", "train.temperature.end=inf must be > 0"),
    ("train.stages=[soft_label,rll]", "train.stages=['soft_label', 'rll'] every entry must be one of"),
    ("eval.temperatures=[0,-1]", "every entry must be >= 0"),
    ("train.data_fraction=0", "train.data_fraction=0.0 must be in (0, 1]"), ("train.data_fraction=1.5", "(0, 1]"),
])
def test_out_of_range_settings_are_refused_before_any_work(override, message):
    from conf.schema import check_config
    from models.errors import DraftheadsError

    with pytest.raises(DraftheadsError, match=re.escape(message)):
        check_config(_compose(["+experiment=smoke", override]))


def test_a_fine_tune_is_never_rated_on_the_problems_it_trained_on():
    from conf.schema import check_config
    from models.errors import DraftheadsError

    check_config(_compose(["+experiment=finetune_code", "data.max_records=150"]))  # domain_skip follows it
    with pytest.raises(DraftheadsError, match=re.escape("eval.domain_skip=100 rates the head on records of "
                                                        "'humaneval' it trained on (data.skip_records + "
                                                        "data.max_records = 124); set eval.domain_skip=124")):
        check_config(_compose(["+experiment=finetune_code", "eval.domain_skip=100"]))
    spelled = ["data.source=prompt_jsonl", "data.path=eval/data/spec_bench_dev.jsonl", "data.max_records=40",
               "eval.domain_prompts=./eval/data/../data/spec_bench_dev.jsonl", "eval.domain_skip=10"]
    with pytest.raises(DraftheadsError, match="eval.domain_skip=10 rates the head on records"):  # the same file
        check_config(_compose(["+experiment=finetune_code", *spelled]))


@pytest.mark.parametrize("override,message", [
    ("train.steps=0", "error: train.steps=0 must be >= 1; fix it on the command line or in the experiment file"),
    ("runtime.device=cuda", "error: runtime.device=cuda but this machine has no CUDA device; use runtime=cpu"),
])
def test_the_cli_refuses_them_in_one_line(override, message, tmp_path):
    r = _cli("+experiment=smoke", override, f"output_dir={tmp_path}/out")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == message
    assert not (tmp_path / "out" / "data").exists()


def test_an_unwritable_output_dir_is_refused_before_any_work(tmp_path):
    (tmp_path / "file").write_text("")  # a directory cannot be made inside a file (chmod does not stop root)
    r = _cli("+experiment=smoke", f"output_dir={tmp_path}/file/run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-1000:]
    assert r.stderr.strip().splitlines()[-1] == (f"error: output_dir '{tmp_path}/file/run' cannot be written (Not a "
                                                 "directory); pick another output_dir")


@pytest.mark.parametrize("overrides,message", [
    (["draft=peagle", "+draft.extra.norm_before_residul=true"], "draft.extra.norm_before_residul is not an option of "
                                                                "draft.family=peagle; it takes norm_before_residual: "
                                                                "bool = False"),
    (["draft=medusa", "+draft.extra.rank=8"], "draft.extra.rank is not an option of draft.family=medusa; it takes none"),
    (["draft=peagle", "+draft.extra.norm_before_residual=yes"], "draft.extra.norm_before_residual='yes' is not a bool"),
    (["draft=dspark", "draft.extra.rank=8.5"], "draft.extra.rank=8.5 is not a int; draft.family=dspark takes sequential: "
                                                "'markov' | 'gated' | 'rnn' = 'markov', rank: int = 256"),
    (["draft=dspark", "draft.extra.rank=0"], "draft.extra.rank=0 must be >= 1"),
    (["draft=dspark", "draft.extra.sequential=none"], "draft.extra.sequential='none' is not a 'markov' | 'gated' | 'rnn'"),
    (["draft=dflash", "+draft.extra.sequential=markov"], "draft.extra.sequential is not an option of "
                                                         "draft.family=dflash; it takes none"),
])
def test_a_typo_in_a_family_option_is_refused_before_any_work(overrides, message):
    from conf.schema import check_config
    from models.errors import DraftheadsError

    with pytest.raises(DraftheadsError, match=re.escape(message)):
        check_config(_compose(["+experiment=smoke", *overrides]))


def test_norm_before_residual_reaches_the_head(tiny_target):
    from models.checkpoint import build_draft

    head = build_draft("peagle", tiny_target, 3, extra={"norm_before_residual": True})
    assert head.config["norm_before_residual"] is True and head.layers[0].norm_before_residual


def test_the_million_token_recipes_share_one_regeneration_and_one_budget():
    from data.prepare import data_settings

    settings, steps = {}, set()
    for family in ("peagle", "eagle3", "dspark", "dflash"):
        cfg = _compose([f"+experiment={family}_smollm2_1m"])
        fingerprint = {"name": cfg.target.name, "tokenizer_hash": "t", "layer_ids": list(cfg.target.layer_ids)}
        settings[family] = data_settings(cfg.data, fingerprint, cfg.train.seed)
        steps.add((cfg.train.steps, cfg.train.batch_size, cfg.accelerate.num_processes, cfg.eval.limit))
        assert cfg.draft.family == family
    assert len({s["regen_sha256"] for s in settings.values()}) == 1 and len(steps) == 1
    assert settings["peagle"]["sha256"] == settings["eagle3"]["sha256"]  # same layers: same features
    assert settings["dspark"]["sha256"] == settings["dflash"]["sha256"] != settings["peagle"]["sha256"]
