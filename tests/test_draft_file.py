"""Draft file format, builder, lookup, merge and refusals, on tiny data with the byte tokenizer."""

import json
import re
from collections import Counter, defaultdict

import numpy as np
import pytest

from data.draft_file import SEED, DraftFile, hash_finish, hash_step
from data.draft_file_build import build, inspect, main, merge, stats
from data.draft_file_tokenize import batch_encoder, document_pieces
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


def reference_table(token_docs, orders, m, L, min_count, pad):
    """The whole table by brute force, Python loops: {key: (order, total, [(tokens, counts)] best first)}.

    Per context: its continuations (L tokens, PAD past the document's end), the prefixes occurring >= min_count
    times, the leaves (kept prefixes no kept prefix extends), ranked by the count of their first token, then of
    their first two (kept or not), then token order; the top m, PAD and 0 past a leaf's end."""
    conts = defaultdict(list)  # (order, context) -> continuations
    for ids in token_docs:
        for i in range(len(ids) - 1):
            cont = tuple(ids[i + 1: i + 1 + L]) + (pad,) * max(0, i + 1 + L - len(ids))
            for k in orders:
                if i - k + 1 >= 0:
                    conts[(k, tuple(ids[i - k + 1: i + 1]))].append(cont)
    table = {}
    for (k, context), rows in conts.items():
        prefix = Counter(row[:j] for row in rows for j in range(1, L + 1))
        kept = {p for p, n in prefix.items() if n >= min_count}
        leaves = [p for p in kept if len(p) == L or not any(p + (t,) in kept for t in {r[len(p)] for r in rows})]
        ranked = sorted(leaves, key=lambda p: (-prefix[p[:1]], -prefix[min(r for r in rows if r[:len(p)] == p)[:2]], p))
        if not ranked:
            continue
        h = SEED
        for t in reversed(context):
            h = hash_step(h, t)
        table[hash_finish(h, k)] = (k, len(rows), [(list(p) + [pad] * (L - len(p)),
                                                    [prefix[p[:j]] for j in range(1, len(p) + 1)] + [0] * (L - len(p)))
                                                   for p in ranked[:m]])
    return table


def file_table(f):
    """The same dict read back from a draft file."""
    offs = f.key_offsets.astype(np.int64)
    return {int(key): (int(o), int(t), [(f.entry_tokens[e].tolist(), f.entry_counts[e].tolist()) for e in range(a, b)])
            for key, o, t, a, b in zip(f.keys, f.key_orders, f.key_totals, offs[:-1], offs[1:])}


@pytest.mark.parametrize("orders,m,L,min_count", [((1, 2, 3, 4), 4, 8, 1), ((1, 2, 3, 4), 4, 8, 2),
                                                  ((1, 3), 2, 5, 3), ((2, 4), 3, 3, 2), ((1, 2), 5, 1, 2)])
def test_sorted_window_counting_equals_brute_force(tmp_path, orders, m, L, min_count):
    """Every key, total, entry and prefix count of the file, against Python loops over the documents."""
    corpus = write_corpus(tmp_path, "c", 20)
    build_tiny([corpus], tmp_path / "a.dfl", orders=orders, continuations=m, max_len=L, min_count=min_count,
               memory_mb=0)  # many partitions, first tokens spread over several
    docs = [TOK(p.read_text(), add_special_tokens=False)["input_ids"] for p in sorted(corpus.iterdir())]
    f = DraftFile(tmp_path / "a.dfl")
    want = reference_table(docs, orders, m, L, min_count, f.pad)
    assert file_table(f) == want and len(want) > 20
    assert list(f.keys) == sorted(want)


def test_32_bit_tokens_and_spread_first_tokens(tmp_path):
    """A vocabulary past 65535 stores 4-byte tokens (two per sort word); a tiny memory budget spreads frequent
    first tokens over partitions. Same table as brute force either way."""
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, 6, size=rng.integers(5, 60)) * 13_000).tolist() for _ in range(60)]  # ids up to 65000
    for memory_mb, name in ((1024, "big"), (0, "small")):
        rep = build([], TOK, tmp_path / f"{name}.dfl", target_name="wide", vocab_size=70_000, min_count=2,
                    validation=0.0, token_docs=docs, memory_mb=memory_mb, log=lambda *_: None)
        f = DraftFile(tmp_path / f"{name}.dfl")
        assert f.entry_tokens.dtype.itemsize == 4
        assert file_table(f) == reference_table(docs, (1, 2, 3, 4), 4, 8, 2, f.pad)
    assert rep["spread_first_tokens"] > 0 and rep["partitions"] > 6
    assert (tmp_path / "big.dfl").read_bytes() == (tmp_path / "small.dfl").read_bytes()


def test_batch_encoder_matches_the_tokenizer_call():
    """Long documents are encoded in pieces cut before a newline that starts a line; the ids never change, and a
    tokenizer the cuts would change (here: a normalizer prepending a marker to every text) is not cut."""
    from tokenizers import normalizers

    long = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(4000))  # > PIECE_CHARS
    pieces = document_pieces(long)
    assert len(pieces) > 1 and "".join(pieces) == long
    assert all(p[0] == "\n" and p[1].strip() for p in pieces[1:])  # each cut: before a newline starting a line
    texts = SNIPPETS + ["<|im_start|>user\nhi<|im_end|>\n", "", "  spaces\n\n\tand tabs  ", long]
    assert batch_encoder(TOK)(texts) == TOK(texts, add_special_tokens=False)["input_ids"]
    marked = tiny_byte_tokenizer()
    marked.backend_tokenizer.normalizer = normalizers.Prepend("#")
    assert batch_encoder(marked)([long]) == marked([long], add_special_tokens=False)["input_ids"]


def reference_tries(token_docs, orders, L, min_count):
    """Brute force with Python loops: {(order, context): (total, {kept prefix: count}, [leaves])}.

    Continuations are padded to L with -1 at a document's end; a prefix is kept when it occurs >= min_count
    times after the context; leaves are kept prefixes that no kept prefix extends."""
    conts = defaultdict(Counter)
    for ids in token_docs:
        for i in range(len(ids) - 1):
            cont = tuple(ids[i + 1: i + 1 + L]) + (-1,) * max(0, i + 1 + L - len(ids))
            for k in orders:
                if i - k + 1 >= 0:
                    conts[(k, tuple(ids[i - k + 1: i + 1]))][cont] += 1
    tries = {}
    for key, counter in conts.items():
        prefix = Counter()
        for cont, n in counter.items():
            for j in range(1, L + 1):
                prefix[cont[:j]] += n
        kept = {p: n for p, n in prefix.items() if n >= min_count}
        leaves = [p for p in kept if len(p) == L or not any(p + (t,) in kept for t in {q[len(p)] for q in kept
                                                                                         if len(q) > len(p) and q[:len(p)] == p})]
        tries[key] = (sum(counter.values()), kept, leaves)
    return tries


def test_lookup_matches_brute_force_tries(tmp_path):
    corpus = write_corpus(tmp_path, "c", 12)
    out = tmp_path / "a.dfl"
    m, L = 3, 5
    build_tiny([corpus], out, orders=(1, 2, 3), continuations=m, max_len=L, min_count=2)
    f = DraftFile(out)
    docs = [TOK(p.read_text(), add_special_tokens=False)["input_ids"] for p in sorted(corpus.iterdir())]
    ref = reference_tries(docs, (1, 2, 3), L, 2)
    checked = 0
    for ids in docs[:3]:
        for i in range(1, len(ids)):
            ctx = ids[:i]
            got = f.lookup(ctx)
            want = next(((k, ref[(k, tuple(ctx[-k:]))]) for k in (3, 2, 1)
                         if len(ctx) >= k and (k, tuple(ctx[-k:])) in ref and ref[(k, tuple(ctx[-k:]))][1]), None)
            if want is None:
                assert got is None
                continue
            k, (total, kept, leaves) = want
            assert got.order == k and got.total == total
            assert len(got.tokens) == min(m, len(leaves))
            for row, counts in zip(got.tokens.tolist(), got.prefix_counts.tolist()):
                leaf = next(p for p in leaves if p == tuple(row[: len(p)]) and all(t == -1 for t in row[len(p):]))
                assert counts == [kept[leaf[: j + 1]] for j in range(len(leaf))] + [0] * (L - len(leaf))
            firsts = got.prefix_counts[:, 0].tolist()
            assert firsts == sorted(firsts, reverse=True) and firsts[0] == max(n for p, n in kept.items() if len(p) == 1)
            checked += 1
    assert checked > 50
    assert f.n_keys > 0 and f.header["min_count"] == 2


def test_batched_lookup_and_hot_table_agree_with_single(tmp_path):
    out = tmp_path / "a.dfl"
    build_tiny([write_corpus(tmp_path, "c", 10)], out, min_count=1)
    f = DraftFile(out)
    ids = TOK("".join(SNIPPETS) + "print(zzz)", add_special_tokens=False)["input_ids"]
    ctx = np.array([[-1] * max(0, 4 - i) + ids[max(0, i - 4): i] for i in range(1, len(ids))])  # [B, 4]
    batch = f.lookup_batch(ctx)
    tokens, counts, order = batch.tokens, batch.prefix_counts, batch.order
    for b in range(len(ctx)):
        single = f.lookup([t for t in ctx[b] if t >= 0])
        if single is None:
            assert order[b] == 0 and counts[b].sum() == 0 and batch.total[b] == 0
        else:
            n = len(single.tokens)
            assert order[b] == single.order and batch.total[b] == single.total
            assert (counts[b, :n] == single.prefix_counts).all() and counts[b, n:].sum() == 0
            assert (tokens[b, :n] == single.tokens).all() and (tokens[b, n:] == -1).all()
            np.testing.assert_array_equal(batch.confidences[b, :n], single.confidences)
            np.testing.assert_array_equal(batch.counts[b, :n], single.counts)
    cold = f.hot_hit_rate(ctx)
    assert cold["hot_share_of_hits"] == 0.0 and 0.5 < cold["hit_rate"] < 1.0
    shares = []
    for x in (0.05, 0.5, 1.0):
        f.place_hot(x)
        hot = f.lookup_batch(ctx)  # same answers from device tensors
        for name in ("tokens", "prefix_counts", "order", "total"):
            np.testing.assert_array_equal(getattr(hot, name), getattr(batch, name))
        shares.append(f.hot_hit_rate(ctx)["hot_share_of_hits"])
    assert shares[0] < shares[1] < shares[2] == 1.0


@pytest.mark.parametrize("vocab_size", [None, 70_000])  # 16-bit and 32-bit token sections
def test_compiled_lookups_equal_the_numpy_reference(tmp_path, vocab_size):
    from data import draft_file

    assert draft_file._CompiledTable is not None, (
        "data/_draft_lookup.c was not compiled: install a C compiler and the Python headers, then `pip install -e .`")
    out = tmp_path / "a.dfl"
    build([str(write_corpus(tmp_path, "c", 10))], TOK, out, target_name="tiny-random-llama",
          vocab_size=vocab_size or len(TOK), validation=0.0, log=lambda *_: None, min_count=1)
    compiled, reference = DraftFile(out), DraftFile(out)
    reference.use_compiled = False
    assert compiled.entry_tokens.dtype.itemsize == (4 if vocab_size else 2)
    ids = TOK("".join(SNIPPETS) + "print(zzz)", add_special_tokens=False)["input_ids"]
    rng = np.random.default_rng(0)
    ctx = np.array([[-1] * max(0, 6 - i) + ids[max(0, i - 6): i] for i in range(len(ids))])  # [B, 6], row 0 empty
    ctx[rng.random(ctx.shape) < 0.05] = -1  # missing tokens inside a context cut it there
    for rows in (ctx, ctx[:1], ctx[:0], ctx[:, -2:]):  # shorter than the longest order too
        got, want = compiled.lookup_batch(rows), reference.lookup_batch(rows)
        for name in ("order", "total", "tokens", "prefix_counts"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
            assert getattr(got, name).dtype == getattr(want, name).dtype
    answered = 0
    for row in ctx:
        tail = row[np.flatnonzero(np.r_[True, row < 0])[-1]:][1:] if (row < 0).any() else row
        for form in (tail, tail.tolist(), tail.astype(np.int32), tail.astype(np.uint16)):
            got, want = compiled.lookup(form), reference.lookup(tail)
            assert (got is None) == (want is None)
            if got is not None:
                assert (got.order, got.total) == (want.order, want.total)
                np.testing.assert_array_equal(got.tokens, want.tokens)
                np.testing.assert_array_equal(got.prefix_counts, want.prefix_counts)
                answered += 1
    assert answered > 100
    with pytest.raises(TypeError, match="1-d array of integer token ids"):
        compiled.lookup(np.array([1.5, 2.0]))


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
    sizes = [c["table_bytes_bound"] for c in curve]
    assert sizes == sorted(sizes, reverse=True)  # higher min-count, smaller table
    chosen = rep["selected"]
    assert chosen["coverage"] >= 0.5
    later = [c for c in curve if c["min_count"] > chosen["min_count"]]
    assert all(c["coverage"] < 0.5 for c in later)
    assert rep["min_count"] == chosen["min_count"] > 1
    # the second count (from sorted windows kept on disk) makes the table a plain build at that min-count makes
    build_tiny([corpus], tmp_path / "plain.dfl", min_count=rep["min_count"], validation=0.2)
    assert file_table(DraftFile(tmp_path / "cov.dfl")) == file_table(DraftFile(tmp_path / "plain.dfl"))


def test_a_file_without_keys_answers_nothing(tmp_path):
    build_tiny([write_corpus(tmp_path, "c", 2)], tmp_path / "none.dfl", min_count=10_000)
    f = DraftFile(tmp_path / "none.dfl")
    assert f.n_keys == 0 and f.lookup([1, 2, 3]) is None
    c = f.lookup_batch(np.array([[1, 2, 3, 4], [-1, -1, -1, 5]]))
    assert (c.order == 0).all() and (c.tokens == -1).all() and (c.prefix_counts == 0).all() and (c.total == 0).all()


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


@pytest.mark.parametrize("kw,bad", [({"orders": (2, 33)}, "orders=(2, 33)"), ({"max_len": 252}, "max-len=252")])
def test_windows_the_counter_cannot_hold_are_refused(tmp_path, kw, bad):
    """order + max-len above 255 wrapped the uint8 count of shared tokens (a 300-token continuation came back as
    198); orders above 32 built, then failed at the first lookup."""
    with pytest.raises(DraftheadsError, match=rf"orders <= 32 and order \+ max-len <= 255; got .*{re.escape(bad)}"):
        build_tiny([write_corpus(tmp_path, "c", 2)], tmp_path / "x.dfl", **kw)


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
    assert rows[0]["confidences"][:3] == [1.0, 1.0, 1.0]  # 'ge(' always follows 'ran'; then '1' or '3'
    assert abs(rows[0]["confidences"][3] + rows[1]["confidences"][3] - 1) < 1e-3
    assert rows == inspect(DraftFile(out), TOK, "for i in ran")
    empty = tmp_path / "empty"
    empty.mkdir()
    code = main(["build", "--corpus", str(empty), "--target", "tiny-random-llama", "--out", str(tmp_path / "e.dfl")])
    assert code == 2 and "produced no tokens" in capsys.readouterr().err


def test_module_entry_point_runs_the_cli(tmp_path):
    """`python -m data.draft_file ...` (the documented command) reaches the CLI in data.draft_file_build."""
    import subprocess
    import sys

    out = tmp_path / "m.dfl"
    build_tiny([write_corpus(tmp_path, "c", 4)], out)
    run = subprocess.run([sys.executable, "-m", "data.draft_file", "stats", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == stats(DraftFile(out))
    run = subprocess.run([sys.executable, "-m", "data.draft_file", "stats", str(tmp_path / "missing.dfl")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "does not exist" in run.stderr


def test_a_rebuild_in_place_leaves_open_readers_on_the_old_file(tmp_path):
    """The file is written under a temporary name and renamed: a process serving from it keeps answering from the
    old table (written in place, its mapping read the new bytes: misses, and a bus error once the file shrank)."""
    out = tmp_path / "d.dfl"
    build_tiny([write_corpus(tmp_path, "big", 10)], out)
    old = DraftFile(out)
    contexts = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [-1, -1, 9, 10]])
    before = old.lookup_batch(contexts)
    assert (before.order > 0).any()
    build_tiny([write_corpus(tmp_path, "small", 2, seed=1)], out, min_count=10_000)  # keyless, smaller
    after = old.lookup_batch(contexts)
    assert np.array_equal(after.tokens, before.tokens) and np.array_equal(after.order, before.order)
    assert DraftFile(out).n_keys == 0 and [p.name for p in tmp_path.iterdir() if p.is_file()] == ["d.dfl"]


def test_builds_the_format_cannot_hold_are_refused_before_counting(tmp_path):
    """Windows spanning 256 tokens once padded to whole sort words (16-bit tokens: order + max-len 253-255) wrapped
    the shared-prefix count and counted one context as many; repeated orders built a file no lookup could read;
    a negative id in pre-tokenized documents failed deep inside numpy."""
    corpus = [write_corpus(tmp_path, "c", 2)]
    with pytest.raises(DraftheadsError, match=r"with 16-bit tokens order \+ max-len must be <= 252; got 4 \+ 250"):
        build_tiny(corpus, tmp_path / "x.dfl", orders=(1, 4), max_len=250)
    with pytest.raises(DraftheadsError, match=r"orders \[1, 2, 2\] repeat an order"):
        build_tiny(corpus, tmp_path / "x.dfl", orders=(1, 2, 2))
    with pytest.raises(DraftheadsError, match="a tokenized document holds id -1"):
        build_tiny([], tmp_path / "x.dfl", token_docs=[[5, 6, -1, 7]])
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    dead = tmp_path / f".dfl-build-{int(gone.stdout)}@{socket.gethostname()}.abc"  # what a build killed with -9 leaves
    elsewhere = tmp_path / f".dfl-build-{int(gone.stdout)}@another-host.abc"  # a build on a shared volume
    for d in (dead, elsewhere):
        d.mkdir()
        (d / "corpus.bin").write_bytes(b"x" * 100)
    build_tiny(corpus, tmp_path / "x.dfl")
    assert not dead.exists() and elsewhere.exists() and (tmp_path / "x.dfl").is_file()
