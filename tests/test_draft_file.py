"""Draft file format, builder, lookup, merge and refusals, on tiny data with the byte tokenizer."""

import json
from collections import Counter, defaultdict

import numpy as np
import pytest

from data.draft_file import DraftFile, build, inspect, main, merge, stats
from models.errors import DraftheadsError
from models.tiny_tokenizer import tiny_byte_tokenizer

TOK = tiny_byte_tokenizer()
SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "def mul(a, b):\n    return a * b\n",
    "import os\nprint(os.getcwd())\n",
    "for key in range(3):\n    print(key, i)\n",
]


def write_corpus(tmp_path, name, n_docs, seed=0):
    """A directory of small code files mixing the snippets (so counts differ per continuation)."""
    rng = np.random.default_rng(seed)
    d = tmp_path / name
    d.mkdir()
    for i in range(n_docs):
        text = "".join(SNIPPETS[j] for j in rng.integers(0, len(SNIPPETS), size=4))
        (d / f"f{i:03d}.py").write_text(text)
    return d


def build_tiny(corpus, out, **kw):
    kw.setdefault("validation", 0.0)
    return build([str(c) for c in corpus], TOK, out, target_name="tiny-random-llama", vocab_size=len(TOK),
                 log=lambda *_: None, **kw)


def reference_table(token_docs, orders, max_len):
    """Brute force: {(order, context tuple): Counter(continuation tuple)} with Python loops."""
    table = defaultdict(Counter)
    for ids in token_docs:
        for i in range(len(ids) - 1):
            for k in orders:
                if i - k + 1 >= 0:
                    table[(k, tuple(ids[i - k + 1: i + 1]))][tuple(ids[i + 1: i + 1 + max_len])] += 1
    return table


def test_lookup_matches_brute_force_counts(tmp_path):
    corpus = write_corpus(tmp_path, "c", 12)
    out = tmp_path / "a.dfl"
    build_tiny([corpus], out, orders=(1, 2, 3), continuations=3, max_len=5, min_count=2)
    f = DraftFile(out)
    docs = [TOK(p.read_text(), add_special_tokens=False)["input_ids"] for p in sorted(corpus.iterdir())]
    ref = reference_table(docs, (1, 2, 3), 5)
    checked = 0
    for ids in docs[:3]:
        for i in range(1, len(ids)):
            ctx = ids[:i]
            got = f.lookup(ctx)
            # expected: the longest order whose best continuation reaches min_count
            want = None
            for k in (3, 2, 1):
                counts = ref.get((k, tuple(ctx[-k:]))) if len(ctx) >= k else None
                if counts and max(counts.values()) >= 2:
                    want = (k, counts)
                    break
            if want is None:
                assert got is None
                continue
            k, counts = want
            assert got.order == k and got.total == sum(counts.values())
            top = sorted((n for n in counts.values() if n >= 2), reverse=True)[:3]
            assert got.counts.tolist() == top
            for row, n in zip(got.tokens.tolist(), got.counts.tolist()):
                assert counts[tuple(t for t in row if t >= 0)] == n
            checked += 1
    assert checked > 50
    assert f.n_keys > 0 and f.header["min_count"] == 2


def test_batched_lookup_and_hot_table_agree_with_single(tmp_path):
    out = tmp_path / "a.dfl"
    build_tiny([write_corpus(tmp_path, "c", 10)], out, min_count=1)
    f = DraftFile(out)
    ids = TOK("".join(SNIPPETS) + "print(zzz)", add_special_tokens=False)["input_ids"]
    ctx = np.array([[-1] * max(0, 4 - i) + ids[max(0, i - 4): i] for i in range(1, len(ids))])  # [B, 4]
    tokens, counts, order = f.lookup_batch(ctx)
    for b in range(len(ctx)):
        single = f.lookup([t for t in ctx[b] if t >= 0])
        if single is None:
            assert order[b] == 0 and counts[b].sum() == 0
        else:
            n = len(single.counts)
            assert order[b] == single.order and counts[b, :n].tolist() == single.counts.tolist()
            assert (tokens[b, :n] == single.tokens).all()
    cold = f.hot_hit_rate(ctx)
    assert cold["hot_share_of_hits"] == 0.0 and 0.5 < cold["hit_rate"] < 1.0
    shares = []
    for x in (0.05, 0.5, 1.0):
        f.place_hot(x)
        hot_tokens, hot_counts, hot_order = f.lookup_batch(ctx)  # same answers from device tensors
        assert (hot_tokens == tokens).all() and (hot_counts == counts).all() and (hot_order == order).all()
        shares.append(f.hot_hit_rate(ctx)["hot_share_of_hits"])
    assert shares[0] < shares[1] < shares[2] == 1.0


def test_merge_of_two_halves_equals_build_of_whole(tmp_path):
    a, b = write_corpus(tmp_path, "a", 6, seed=1), write_corpus(tmp_path, "b", 6, seed=2)
    build_tiny([a, b], tmp_path / "whole.dfl", min_count=2, validation=0.2)
    build_tiny([a], tmp_path / "half.dfl", min_count=2, validation=0.2)
    merge(DraftFile(tmp_path / "half.dfl"), [str(b)], TOK, tmp_path / "merged.dfl")
    whole, merged = (tmp_path / "whole.dfl").read_bytes(), (tmp_path / "merged.dfl").read_bytes()
    assert whole == merged
    # and pruning is what makes it non-trivial: the half alone lacks keys the whole has
    assert DraftFile(tmp_path / "half.dfl").n_keys < DraftFile(tmp_path / "whole.dfl").n_keys


def test_small_memory_budget_spills_partitions_with_identical_result(tmp_path):
    corpus = write_corpus(tmp_path, "c", 30)
    big = build_tiny([corpus], tmp_path / "big.dfl", memory_mb=1024)
    small = build_tiny([corpus], tmp_path / "small.dfl", memory_mb=0)  # forces one partition per 64 KiB of records
    assert big["partitions"] == 1 and small["partitions"] > 8
    assert (tmp_path / "big.dfl").read_bytes() == (tmp_path / "small.dfl").read_bytes()


def test_coverage_picks_the_smallest_table_reaching_it(tmp_path):
    corpus = write_corpus(tmp_path, "c", 60)
    rep = build_tiny([corpus], tmp_path / "cov.dfl", coverage=0.5, validation=0.2)
    curve = DraftFile(tmp_path / "cov.dfl").header["validation"]["curve"]
    assert rep["validation_tokens"] > 0 and len(curve) > 3
    sizes = [c["table_bytes"] for c in curve]
    assert sizes == sorted(sizes, reverse=True)  # higher min-count, smaller table
    chosen = rep["selected"]
    assert chosen["coverage"] >= 0.5
    later = [c for c in curve if c["min_count"] > chosen["min_count"]]
    assert all(c["coverage"] < 0.5 for c in later)
    assert rep["min_count"] == chosen["min_count"] > 1


def test_foreign_tokenizer_is_refused(tmp_path, tiny_target):
    other = tiny_byte_tokenizer()
    other.add_tokens(["<extra_token>"])
    out = tmp_path / "foreign.dfl"
    build([str(write_corpus(tmp_path, "c", 3))], other, out, target_name="other", vocab_size=len(other),
          validation=0.0, log=lambda *_: None)
    f = DraftFile(out)
    with pytest.raises(DraftheadsError, match="tokenizer_hash.*rebuild it for this target"):
        f.check_target(tiny_target)
    with pytest.raises(DraftheadsError, match="rebuild the file with this target's tokenizer"):
        f.check_tokenizer(TOK)
    build_tiny([write_corpus(tmp_path, "d", 3)], tmp_path / "mine.dfl")
    DraftFile(tmp_path / "mine.dfl").check_target(tiny_target)  # the matching target passes


def test_truncated_or_corrupted_files_are_refused(tmp_path):
    out = tmp_path / "a.dfl"
    build_tiny([write_corpus(tmp_path, "c", 4)], out)
    data = out.read_bytes()
    cases = {
        "truncated": data[: len(data) - 100],
        "body": data[:-50] + bytes([data[-50] ^ 1]) + data[-49:],
        "header": data[:40] + bytes([data[40] ^ 1]) + data[41:],
        "magic": b"NOTADFL!" + data[8:],
    }
    messages = {"truncated": "truncated", "body": "body checksum", "header": "corrupted or truncated header",
                "magic": "not a draft file"}
    for name, blob in cases.items():
        bad = tmp_path / f"{name}.dfl"
        bad.write_bytes(blob)
        with pytest.raises(DraftheadsError, match=messages[name]):
            DraftFile(bad)


def test_empty_corpus_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DraftheadsError, match="produced no tokens"):
        build_tiny([empty], tmp_path / "x.dfl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DraftheadsError, match="produced no tokens"):
        build_tiny([tmp_path / "empty.jsonl"], tmp_path / "x.dfl")


def test_no_corpus_file_is_smaller_and_refuses_merge(tmp_path):
    corpus = write_corpus(tmp_path, "c", 5)
    build_tiny([corpus], tmp_path / "full.dfl")
    build_tiny([corpus], tmp_path / "serve.dfl", keep_corpus=False)
    full, serve = DraftFile(tmp_path / "full.dfl"), DraftFile(tmp_path / "serve.dfl")
    assert serve.header["file_bytes"] < full.header["file_bytes"]
    assert serve.header["table_bytes"] == full.header["table_bytes"]
    with pytest.raises(DraftheadsError, match="--no-corpus"):
        merge(serve, [str(corpus)], TOK, tmp_path / "m.dfl")


def test_cli_build_stats_inspect(tmp_path, capsys):
    corpus = write_corpus(tmp_path, "c", 8)
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "print(i)"}]}) + "\n")
    out = tmp_path / "cli.dfl"
    main(["build", "--corpus", str(corpus), str(jsonl), "--target", "tiny-random-llama", "--orders", "1,2,3",
          "--max-len", "6", "--out", str(out), "--validation", "0"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["keys"] > 0 and report["tokens"] > 0
    main(["stats", str(out)])
    s = json.loads(capsys.readouterr().out)
    assert s["orders"] == [1, 2, 3] and sum(v["entries"] for v in s["per_order"].values()) == s["entries"]
    assert s == stats(DraftFile(out))
    main(["inspect", str(out), "--text", "for i in ran", "--target", "tiny-random-llama"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["continuation"][:5] for r in rows} == {"ge(10", "ge(3)"} and rows[0]["order"] == 3
    assert rows[0]["count"] >= rows[1]["count"] and abs(sum(r["confidence"] for r in rows) - 1) < 0.01
    assert rows == inspect(DraftFile(out), TOK, "for i in ran")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as e:
        main(["build", "--corpus", str(empty), "--target", "tiny-random-llama", "--out", str(tmp_path / "e.dfl")])
    assert e.value.code == 2 and "produced no tokens" in capsys.readouterr().err
