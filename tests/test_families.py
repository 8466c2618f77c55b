"""A family is one module and one registry line: the toy family of tests/toy_family.py trains, saves, loads, is
checked by the config layer and drafts losslessly through head:DIR, with no other change to the toolkit."""

import json

import torch

import toy_family
from models.families import Family, register

register(Family("toy", toy_family.ToyHead, toy_family.build))  # the one registry line


def test_a_new_family_trains_saves_loads_and_drafts_losslessly(tiny_target, tmp_path):
    from omegaconf import OmegaConf

    from conf.schema import Config, check_config
    from inference.generate import generate_plain, speculative_generate
    from inference.sampling import SamplingConfig
    from inference.sources import build_source
    from models.checkpoint import load_draft
    from test_trainer import make_cfg, tiny_features
    from train.trainer import train_draft

    cfg = make_cfg(tmp_path, steps=15)
    cfg.draft.family = "toy"
    check_config(OmegaConf.merge(OmegaConf.structured(Config), cfg))  # the config layer knows it
    head_dir = train_draft(cfg, tiny_target, tiny_features(tiny_target), tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    head = load_draft(head_dir, tiny_target)
    assert isinstance(head, toy_family.ToyHead) and head.k == 3
    source = build_source(f"head:{head_dir}", tiny_target)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0))
    plain = generate_plain(tiny_target, prompt, 20, SamplingConfig(), eos_ids=[])
    spec = speculative_generate(tiny_target, source, prompt, 20, 3, SamplingConfig(), eos_ids=[])
    assert spec.tokens == [plain] and spec.stats.rounds <= 20
