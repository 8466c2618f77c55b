import json

import pytest
import torch

from data.chat import tokenize_chat
from data.features import FeatureDataset, extract_features
from data.regenerate import record_files, regenerate, regeneration_totals
from models.errors import DraftheadsError

CONVS = [[{"role": "user", "content": f"question number {i} " * (1 + i % 3)},
          {"role": "assistant", "content": "old answer"},
          {"role": "user", "content": "second turn"},
          {"role": "assistant", "content": "old two"}] for i in range(10)]


def test_regeneration_is_deterministic_and_resumes(tiny_target, tmp_path):
    kw = dict(max_new=12, turns=2, batch_size=4, temperature=1.0, seed=3)
    full = regenerate(tiny_target, CONVS, tmp_path / "full.jsonl", **kw)
    assert full["records"] == 10 and full["new_tokens"] > 0
    lines = (tmp_path / "full.jsonl").read_text().splitlines()
    # a kill after the first batch, in the middle of writing the second line of batch 2
    (tmp_path / "part.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])
    again = regenerate(tiny_target, CONVS, tmp_path / "part.jsonl", **kw)
    assert again["new_tokens"] < full["new_tokens"]  # only the missing batches were generated
    # the progress file counts every run's generation: a resumed file's totals add up across the runs
    (tmp_path / "part.jsonl.progress.json").write_text(json.dumps({"runs": 1, "new_tokens": 5, "seconds": 2.0}))
    (tmp_path / "part.jsonl").write_text("\n".join(lines[:4]) + "\n")
    third = regenerate(tiny_target, CONVS, tmp_path / "part.jsonl", **kw)
    totals = regeneration_totals(tmp_path / "part.jsonl")
    assert totals["runs"] == 2 and totals["new_tokens"] == 5 + third["new_tokens"] and totals["seconds"] > 2.0
    assert regeneration_totals(tmp_path / "full.jsonl")["new_tokens"] == full["new_tokens"]
    (tmp_path / "full.jsonl").unlink()  # "remove the file to regenerate everything": its old counts go with it
    fresh = regenerate(tiny_target, CONVS, tmp_path / "full.jsonl", **kw)
    after = regeneration_totals(tmp_path / "full.jsonl")
    assert after["runs"] == 1 and after["new_tokens"] == fresh["new_tokens"]
    assert sorted((tmp_path / "part.jsonl").read_text().splitlines()) == sorted(lines)
    rec = json.loads(lines[0])
    roles = [t["role"] for t in rec["conversation"]]
    assert roles == ["user", "assistant", "user", "assistant"] and len(rec["finished"]) == 2
    assert rec["conversation"][1]["content"] != "old answer"


def test_regeneration_resumed_with_another_process_count_reuses_the_records(tiny_target, tmp_path):
    """A 2-process regeneration killed after rank 0's share, resumed by one process: only rank 1's batches are made,
    and the one file holds what one process alone writes (seeds follow the batch)."""
    kw = dict(max_new=8, turns=1, batch_size=2, temperature=1.0, seed=5)
    alone = regenerate(tiny_target, CONVS, tmp_path / "one.jsonl", **kw)
    half = regenerate(tiny_target, CONVS, tmp_path / "mixed.jsonl", rank=0, world=2, **kw)  # rank 1 never ran
    rest = regenerate(tiny_target, CONVS, tmp_path / "mixed.jsonl", **kw)
    assert rest["new_tokens"] == alone["new_tokens"] - half["new_tokens"] > 0
    assert sorted((tmp_path / "mixed.jsonl").read_text().splitlines()) == sorted(
        (tmp_path / "one.jsonl").read_text().splitlines())
    assert regeneration_totals(tmp_path / "mixed.jsonl")["new_tokens"] == alone["new_tokens"]


def test_a_two_process_merge_keeps_answers_outside_its_records(tiny_target, tmp_path):
    """10 records answered by one process, then a 2-process run over the first 4: the merged file still holds all 10
    (a later run with more records reuses them), the 4 first in batch order."""
    from data.regenerate import merge_parts

    out, kw = tmp_path / "r.jsonl", dict(max_new=4, turns=1, batch_size=2)
    regenerate(tiny_target, CONVS, out, **kw)
    before = {json.loads(x)["id"]: x for x in out.read_text().splitlines()}
    for rank in (0, 1):
        regenerate(tiny_target, CONVS[:4], out, rank=rank, world=2, **kw)
    merge_parts(tiny_target.tokenizer, CONVS[:4], out, 1, 2, 1024)
    after = out.read_text().splitlines()
    assert sorted(after) == sorted(before.values()) and [json.loads(x)["id"] for x in after[4:]] == list(range(4, 10))


def test_a_replanned_rank_does_not_answer_what_another_rank_answered(tiny_target, tmp_path):
    """2 processes over 4 records, then over all 10 (the batches are planned again): no id is answered twice."""
    from data.regenerate import part_path

    out, kw = tmp_path / "r.jsonl", dict(max_new=4, turns=1, batch_size=2)
    for convs in (CONVS[:4], CONVS):
        for rank in (0, 1):
            regenerate(tiny_target, convs, out, rank=rank, world=2, **kw)
    ids = [[json.loads(x)["id"] for x in part_path(out, r, 2).read_text().splitlines()] for r in (0, 1)]
    assert sorted(ids[0] + ids[1]) == list(range(10))


def test_regeneration_totals_add_runs_of_every_process_count(tmp_path):
    """Parts of one process count ran side by side (the slowest counts), runs of different counts one after another
    (they add up); a progress file whose part file is gone counts nothing."""
    counts = {"x.part_0-of-2.jsonl": (1, 10, 4.0), "x.part_1-of-2.jsonl": (1, 6, 5.0), "x.jsonl": (2, 3, 1.0),
              "x.part_0-of-4.jsonl": (1, 50, 9.0), "xy.jsonl": (1, 100, 1.0)}  # (runs, new tokens, seconds)
    for name, (runs, tokens, seconds) in counts.items():
        (tmp_path / f"{name}.progress.json").write_text(json.dumps({"runs": runs, "new_tokens": tokens,
                                                                    "seconds": seconds}))
        if name != "x.part_0-of-4.jsonl":  # its records were removed
            (tmp_path / name).write_text('{"id": 0}\n')
    (tmp_path / "x.part_0-of-8.jsonl").write_text("")  # a run killed before its first batch: holds nothing
    assert [p.name for p, _ in record_files(tmp_path / "x.jsonl")] == [
        "x.jsonl", "x.part_0-of-2.jsonl", "x.part_1-of-2.jsonl"]
    assert regeneration_totals(tmp_path / "x.jsonl") == {"runs": 3, "new_tokens": 19, "seconds": 6.0,
                                                         "tokens_per_s": round(19 / 6, 1)}


def test_resume_keeps_records_with_unicode_line_separators(tmp_path):
    """U+2028 / U+0085 inside a regenerated answer are raw in the JSONL (ensure_ascii=False); a resume that split on
    them dropped the record and rewrote the file without it (one of 3135 SmolLM2 records was lost that way)."""
    from data.regenerate import _read_done

    path = tmp_path / "r.jsonl"
    recs = [{"id": i, "conversation": [{"role": "assistant", "content": f"a\u2028b\x85c {i}"}]} for i in range(3)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    before = path.read_text(encoding="utf-8")
    assert sorted(_read_done(path)) == [0, 1, 2] and path.read_text(encoding="utf-8") == before


def test_long_prompts_are_skipped_and_counted(tiny_target, tmp_path):
    report = regenerate(tiny_target, CONVS, tmp_path / "r.jsonl", max_new=4, max_prompt_tokens=60)
    assert report["skipped_long_prompt"] > 0 and report["records"] + report["skipped_long_prompt"] == 10


def _sequences(tok, n=7):
    return [(tc.input_ids, tc.loss_mask) for tc in (tokenize_chat(tok, c) for c in CONVS[:n])]


def test_features_recompute_target_logits_and_resume(tiny_target, tmp_path):
    seqs = _sequences(tiny_target.tokenizer)
    full = extract_features(tiny_target, seqs, tmp_path / "a", shard_tokens=150)
    ds = FeatureDataset(tmp_path / "a")
    assert len(ds) == 7 and full["tokens"] == sum(len(s[0]) for s in seqs) and len(ds.manifest["shards"]) > 2
    ex = ds[5]
    assert torch.equal(ex["input_ids"], seqs[5][0]) and torch.equal(ex["loss_mask"], seqs[5][1])
    ref = tiny_target(seqs[5][0][None])
    assert torch.allclose(ex["aux_hidden"], ref.aux_hidden[0], atol=0.05, rtol=0.02)  # bf16 storage
    logits = tiny_target.lm_head(ex["final_hidden"])
    assert (logits.argmax(-1) == ref.logits[0].argmax(-1)).float().mean() > 0.95

    # a kill after two shards: drop later shards from the manifest, resume, same data
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    man["shards"], man["complete"] = man["shards"][:2], False
    man["sequences_done"] = sum(s["sequences"] for s in man["shards"])
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(DraftheadsError, match="incomplete.*resume"):
        FeatureDataset(tmp_path / "a")
    resumed = extract_features(tiny_target, seqs, tmp_path / "a", shard_tokens=150)
    assert resumed["new_tokens"] < full["tokens"] and resumed["tokens"] == full["tokens"]
    ds2 = FeatureDataset(tmp_path / "a")
    assert all(torch.equal(ds2[i]["aux_hidden"], FeatureDataset(tmp_path / "a")[i]["aux_hidden"]) for i in range(7))
    assert torch.equal(ds2[5]["final_hidden"], ex["final_hidden"])


def test_length_sorted_batches_change_no_feature(tiny_target, tmp_path):
    from data.features import _length_sorted_batches

    lengths = [5, 40, 7, 33, 12, 40, 3]
    batches = _length_sorted_batches(lengths, 64)
    assert sorted(j for b in batches for j in b) == list(range(7))  # every row once
    assert all(len(b) * max(lengths[j] for j in b) <= 64 or len(b) == 1 for b in batches)
    assert [lengths[j] for b in batches for j in b] == sorted(lengths)
    seqs = _sequences(tiny_target.tokenizer)
    extract_features(tiny_target, seqs, tmp_path / "one", shard_tokens=150, batch_tokens=1)  # a row per forward
    extract_features(tiny_target, seqs, tmp_path / "many", shard_tokens=150, batch_tokens=4096)
    one, many = FeatureDataset(tmp_path / "one"), FeatureDataset(tmp_path / "many")
    for i in range(len(seqs)):  # rows in sequence order, the same numbers whatever the batch
        a, b = one[i], many[i]
        assert torch.equal(a["input_ids"], seqs[i][0]) and torch.equal(a["input_ids"], b["input_ids"])
        torch.testing.assert_close(a["aux_hidden"], b["aux_hidden"], atol=1e-2, rtol=1e-2)
        assert (a["target_argmax"] == b["target_argmax"]).float().mean() > 0.95


def test_features_of_another_target_are_refused(tiny_target, tmp_path):
    from models.target import Target, tiny_random_llama

    extract_features(tiny_target, _sequences(tiny_target.tokenizer, 2), tmp_path / "f")
    model, tok = tiny_random_llama(num_layers=6, hidden_size=32)
    other = Target(model, tok, "other-tiny")
    with pytest.raises(DraftheadsError, match="built for target 'tiny-random-llama'.*hidden_size"):
        extract_features(other, _sequences(tok, 2), tmp_path / "f")
    # the same sizes and tokenizer, other weights (target.path / target.dtype) or another name: other hidden states
    sequences = _sequences(tiny_target.tokenizer, 3)
    finetuned = {"path": str(tmp_path / "finetuned")}
    with pytest.raises(DraftheadsError, match="holds hidden states of target 'tiny-random-llama' loaded with its "
                                              "built-in weights; this run loads 'tiny-random-llama' with {'path'"):
        extract_features(tiny_target, sequences, tmp_path / "f", weights=finetuned)
    with pytest.raises(DraftheadsError, match="this run loads 'base-model'"):
        extract_features(Target(tiny_target.model, tiny_target.tokenizer, "base-model"), sequences, tmp_path / "f")
    assert extract_features(tiny_target, sequences, tmp_path / "f")["sequences"] == 3  # the same target resumes
    extract_features(tiny_target, sequences, tmp_path / "t", hidden=False)  # tokens depend on the tokenizer only
    assert extract_features(tiny_target, sequences, tmp_path / "t", hidden=False, weights=finetuned)["new_tokens"] == 0


def test_a_tokens_only_directory_serves_any_feature_dtype_and_a_stored_one_its_own(tiny_target, tmp_path):
    """Online data holds tokens only, so another data.feature_dtype (the rounding applied in the step) reuses it;
    it was refused with 'holds tokens only; this run asks for tokens only'. Stored states keep their dtype."""
    seqs = _sequences(tiny_target.tokenizer, 2)
    extract_features(tiny_target, seqs, tmp_path / "on", hidden=False, dtype="bfloat16")
    assert extract_features(tiny_target, seqs, tmp_path / "on", hidden=False, dtype="int8")["new_tokens"] == 0
    extract_features(tiny_target, seqs, tmp_path / "off", dtype="bfloat16")
    with pytest.raises(DraftheadsError, match="holds .*bfloat16.*this run asks for .*int8"):
        extract_features(tiny_target, seqs, tmp_path / "off", dtype="int8")


def test_features_of_other_sequences_are_refused(tiny_target, tmp_path):
    """Resume is by count; the manifest's digest makes changed data (other records, other data.* settings) an error
    instead of features silently paired with the wrong sequences. A longer list with the same prefix extends."""
    seqs = _sequences(tiny_target.tokenizer, 4)
    extract_features(tiny_target, seqs[:3], tmp_path / "f", shard_tokens=150)
    assert extract_features(tiny_target, seqs, tmp_path / "f", shard_tokens=150)["sequences"] == 4
    with pytest.raises(DraftheadsError, match="not the first 4 of the 4.*delete it or use a new output_dir"):
        extract_features(tiny_target, seqs[1:] + seqs[:1], tmp_path / "f")
    with pytest.raises(DraftheadsError, match="not the first 4 of the 2"):
        extract_features(tiny_target, seqs[:2], tmp_path / "f")


def test_two_processes_extend_features_to_more_sequences(tiny_target, tmp_path):
    """With 2 processes, more sequences move rank 1's block: its part is made again (rank 0's extends) and the merged
    directory equals one process's extraction of all of them."""
    from data.features import merge_parts

    seqs = _sequences(tiny_target.tokenizer, 10)
    for n in (6, 10):
        for rank in (0, 1):
            extract_features(tiny_target, seqs[:n], tmp_path / "two", shard_tokens=64, rank=rank, world=2)
            if n == 10 and rank == 1:  # its part is being made again: the 6-sequence directory is no longer whole
                assert not (tmp_path / "two" / "manifest.json").exists()
        merge_parts(tmp_path / "two", 2)
    extract_features(tiny_target, seqs, tmp_path / "one", shard_tokens=64)
    two, one = FeatureDataset(tmp_path / "two"), FeatureDataset(tmp_path / "one")
    assert len(two) == len(one) == 10
    for i in range(10):
        assert torch.equal(two[i]["input_ids"], one[i]["input_ids"])
        assert torch.equal(two[i]["final_hidden"], one[i]["final_hidden"])
