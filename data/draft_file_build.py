"""Building DFlash draft files (format: data/draft_file.py): tokenize, count, size by coverage, merge; the CLI.

    python -m data.draft_file build --corpus PATH... --target NAME_OR_PATH --orders 1,2,3,4 \
        --continuations 4 --max-len 8 [--min-count 2 | --coverage 0.6] --out FILE.dfl
    python -m data.draft_file stats FILE.dfl
    python -m data.draft_file inspect FILE.dfl --text "def main(" --target NAME_OR_PATH
    python -m data.draft_file merge FILE.dfl --corpus PATH... --target NAME_OR_PATH --out NEW.dfl

`--coverage C` picks the largest min-count whose validation coverage (the served key's best leaf
starts with the right token) is still >= C, from a curve measured on held-out documents.

Mergeability. Counts add across corpora but a count threshold does not (1 + 1 passes min-count 2,
neither half does), so a file also stores its tokenized corpus and validation split (2 bytes a token
for vocabularies under 65535): the exact sufficient statistic. `merge` appends the new corpus's tokens
and recounts, so merge(build(A), B) == build(A + B) byte for byte; only the new corpus is tokenized
(the slow part). `--no-corpus` writes a serving-only file, which merge refuses.

Streaming. Documents are tokenized in batches and appended to a temporary token file; (key, position)
records are partitioned by the key's top bits into spill files sized to `--memory-mb`, and each
partition is sorted and counted alone, its result spilled too, so memory stays one partition.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from data.draft_file import SEED, U64, VERSION, DraftFile, context_keys, hash_finish, hash_step, token_dtype, write_file
from models.errors import DraftheadsError

REC = np.dtype([("key", "<u8"), ("pos", "<i8")])  # one spill record: context key, (order << 56) | position
THRESHOLDS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)


# ---------------------------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------------------------
def iter_token_docs(paths: Iterable[str], tokenizer, batch_docs: int = 256) -> Iterator[tuple[np.ndarray, str]]:
    """(token ids, text) per document of every corpus path, tokenized in batches with the fast tokenizer."""
    from data.readers import iter_documents

    batch: list[str] = []
    for path in paths:
        for text in iter_documents(path, tokenizer):
            batch.append(text)
            if len(batch) == batch_docs:
                yield from _tokenize(batch, tokenizer)
                batch = []
    yield from _tokenize(batch, tokenizer)


def _tokenize(texts: list[str], tokenizer):
    if texts:
        for ids, text in zip(tokenizer(texts, add_special_tokens=False)["input_ids"], texts):
            yield np.asarray(ids, dtype=np.int64), text


def is_validation(text: str | bytes, fraction: float) -> bool:
    """Held-out split by content hash: independent of corpus order, batching and merging."""
    data = text.encode() if isinstance(text, str) else text
    return fraction > 0 and zlib.crc32(data) % 10_000 < fraction * 10_000


class _TokenSink:
    """Appends documents to a token file; tracks document offsets."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.f, self.dtype, self.offsets = open(path, "wb"), dtype, [0]

    def add(self, ids: np.ndarray) -> None:
        if len(ids):
            ids.astype(self.dtype).tofile(self.f)
            self.offsets.append(self.offsets[-1] + len(ids))

    def close(self) -> tuple[int, np.ndarray]:
        self.f.close()
        return self.offsets[-1], np.asarray(self.offsets, dtype=np.uint64)


def _records(tokens: np.ndarray, doc_offsets: np.ndarray, start: int, end: int, orders, max_len: int, pad: int):
    """Spill records for contexts ending at positions [start, end) of the token array (vectorised)."""
    offs, W, n = doc_offsets.astype(np.int64), max(orders), end - start
    lo, hi = max(0, start - W + 1), min(len(tokens), end)
    window = np.zeros(n + W - 1, dtype=np.int64)  # window[W - 1 + i] = token at position start + i
    window[lo - (start - W + 1): lo - (start - W + 1) + hi - lo] = tokens[lo:hi]
    pos = np.arange(start, end, dtype=np.int64)
    i0, i1 = np.searchsorted(offs, [start, end - 1], side="right") - 1  # documents overlapping the chunk
    doc = np.repeat(np.arange(i0, i1 + 1), np.diff(np.clip(offs[i0: i1 + 2], start, end)))
    d0, d1 = offs[doc], offs[doc + 1]
    out, h = [], np.full(n, SEED, dtype=U64)
    for j in range(W):
        h = hash_step(h, window[W - 1 - j: W - 1 - j + n])
        if j + 1 not in orders:
            continue
        ok = (pos - j >= d0) & (pos + 1 < d1)  # k tokens of context and >= 1 continuation token, same document
        rec = np.empty(int(ok.sum()), dtype=REC)
        rec["key"], rec["pos"] = hash_finish(h[ok], j + 1), pos[ok] | ((j + 1) << 56)  # the order rides in the top byte
        out.append(rec)
    return np.concatenate(out) if out else np.empty(0, dtype=REC)


def _count_partition(rec: np.ndarray, tokens, doc_offsets, m: int, max_len: int, min_count: int, pad: int, tdt):
    """One partition's keys: their continuation tries cut where a prefix occurs < min_count times, top-m leaves.

    Records sorted by (key, continuation tokens) put every prefix's occurrences in one run, so all prefix
    counts (how often the key is followed by t1..tj) come from run lengths, one linear pass per level. The
    best leaf follows the most frequent first token, then the most frequent second one; ties in token order."""
    L, R = max_len, len(rec)
    pos = rec["pos"] & ((1 << 56) - 1)
    offs = doc_offsets.astype(np.int64)
    d1 = offs[np.searchsorted(offs, pos, side="right")]
    idx = pos[:, None] + 1 + np.arange(L)[None, :]  # [R, L]
    cont = np.where(idx < d1[:, None], tokens[np.minimum(idx, len(tokens) - 1)], pad).astype(np.int64)
    del idx
    bits = 16 if pad < (1 << 16) else 32  # pack tokens into 64-bit words: lexicographic order = word order
    words = []
    for a in range(0, L, 64 // bits):
        w = np.zeros(R, dtype=U64)
        for t in cont[:, a: a + 64 // bits].T:
            w = (w << U64(bits)) | t.astype(U64)
        words.append(w)
    order = np.lexsort(tuple(reversed(words)) + (rec["key"],))  # primary key last
    key, cont, korder = rec["key"][order], cont[order].astype(np.int32), rec["pos"][order] >> 56
    del words, order
    boundary = np.ones(R, dtype=bool)
    boundary[1:] = key[1:] != key[:-1]
    key_start = np.flatnonzero(boundary)
    pc = np.zeros((R, L), dtype=np.int32)  # [R, L] prefix counts
    levels = []
    for j in range(L):
        boundary[1:] |= cont[1:, j] != cont[:-1, j]
        run = np.diff(np.r_[np.flatnonzero(boundary), R])
        pc[:, j] = np.repeat(run, run)
        levels.append(boundary.copy())
    depth = (pc >= min_count).sum(1)  # kept prefix length: prefix counts never grow with j
    leaf = np.zeros(R, dtype=bool)  # first row of a kept prefix's run that no kept prefix extends
    for j, b in enumerate(levels):
        st = np.flatnonzero(b)
        deepest = np.repeat(np.maximum.reduceat(depth, st), np.diff(np.r_[st, R])) if R else depth
        leaf |= b & (depth == j + 1) & (deepest == j + 1)
    rows = np.flatnonzero(leaf)  # in (key, tokens) order
    second = pc[rows, 1] if L > 1 else np.zeros(len(rows), np.int32)
    rows = rows[np.lexsort((-second, -pc[rows, 0], key[rows]))]  # stable: ties stay in token order
    new = np.r_[True, key[rows][1:] != key[rows][:-1]] if len(rows) else np.empty(0, bool)
    rank = np.arange(len(rows)) - np.flatnonzero(new)[np.cumsum(new) - 1] if len(rows) else rows
    rows, new = rows[rank < m], new[rank < m]
    heads = rows[new]
    cut = np.arange(L)[None, :] >= depth[rows][:, None]  # [E, L] beyond the kept prefix
    return {"keys": key[heads], "orders": korder[heads].astype(np.int64),
            "totals": np.diff(np.r_[key_start, R])[np.searchsorted(key[key_start], key[heads])].astype(np.uint32),
            "n_entries": np.diff(np.r_[np.flatnonzero(new), len(rows)]).astype(np.int64),
            "counts": np.where(cut, 0, pc[rows]).astype(np.uint32),
            "tokens": np.where(cut, pad, cont[rows]).astype(tdt)}


def build(corpus: list[str] | None, tokenizer, out: str | Path, *, target_name: str, vocab_size: int,
          orders=(1, 2, 3, 4), continuations: int = 4, max_len: int = 8, min_count: int = 2,
          coverage: float | None = None, validation: float = 0.02, keep_corpus: bool = True,
          memory_mb: int = 1024, base: DraftFile | None = None, token_docs: Iterable | None = None,
          log=print) -> dict:
    """Build a draft file from corpora (and `base`'s stored corpus first, for merge); returns the build report.

    `token_docs`: documents already tokenized (e.g. regenerated outputs as id lists), counted after the corpora."""
    from models.target import tokenizer_hash

    t0 = time.perf_counter()
    orders = tuple(sorted(int(o) for o in orders))
    if not orders or orders[0] < 1 or continuations < 1 or max_len < 1 or min_count < 1:
        raise DraftheadsError(f"draft file build needs orders >= 1, continuations >= 1, max-len >= 1, min-count >= 1; "
                              f"got orders={orders}, continuations={continuations}, max-len={max_len}, min-count={min_count}")
    tdt = token_dtype(vocab_size)
    pad = int(np.iinfo(tdt).max)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".dfl-build-") as tmp:
        tmp = Path(tmp)
        sink, val = _TokenSink(tmp / "corpus.bin", tdt), _TokenSink(tmp / "val.bin", tdt)
        sources = list(base.header["sources"]) if base is not None else []
        if base is not None:  # stored corpus first, so merge(build(A), B) sees exactly build(A + B)'s token stream
            offs = base.doc_offsets.astype(np.int64)
            for a, b in zip(offs[:-1], offs[1:]):
                sink.add(base.corpus_tokens[a:b])
            offs = base.val_offsets.astype(np.int64)
            for a, b in zip(offs[:-1], offs[1:]):
                val.add(base.val_tokens[a:b])
        n_docs = 0
        pretokenized = ((np.asarray(d, dtype=np.int64), None) for d in token_docs or [])
        for ids, text in itertools.chain(iter_token_docs(corpus or [], tokenizer), pretokenized):
            if len(ids) and int(ids.max()) >= vocab_size:
                raise DraftheadsError(f"tokenizer produced id {int(ids.max())} >= vocab size {vocab_size}; "
                                      "pass the target whose tokenizer this is (--target)")
            (val if is_validation(text if text is not None else ids.tobytes(), validation) else sink).add(ids)
            n_docs += 1
            if n_docs % 5000 == 0:
                log(f"[draft_file] tokenized {n_docs} documents, {sink.offsets[-1]:,} tokens")
        sources += [str(p) for p in corpus or []]
        n_tokens, doc_offsets = sink.close()
        n_val, val_offsets = val.close()
        if n_tokens == 0:
            raise DraftheadsError(f"corpus {list(corpus or [])} produced no tokens to count (empty, unreadable or all "
                                  "held out for validation); pass non-empty text / JSONL / code directories")
        t_tok = time.perf_counter() - t0
        tokens = np.memmap(tmp / "corpus.bin", dtype=tdt, mode="r", shape=(n_tokens,))

        # 1. spill (key, pos) records into partitions by the key's top bits (partition order = key order)
        n_rec = n_tokens * len(orders)
        budget = max(int(memory_mb * 2**20), 1 << 16)  # bytes one partition may use while counted (~40x its records)
        bits = min(10, max(0, math.ceil(math.log2(max(1.0, n_rec * REC.itemsize * 40 / budget)))))
        parts = [open(tmp / f"part{p:04d}.bin", "wb") for p in range(1 << bits)]
        chunk = max(1 << 12, budget // (REC.itemsize * len(orders) * 8))
        for a in range(0, n_tokens, chunk):
            rec = _records(tokens, doc_offsets, a, min(n_tokens, a + chunk), orders, max_len, pad)
            part = (rec["key"] >> U64(64 - bits)).astype(np.int64) if bits else np.zeros(len(rec), np.int64)
            rec = rec[np.argsort(part, kind="stable")]
            cuts = np.searchsorted(np.sort(part), np.arange(len(parts) + 1))
            for p, f in enumerate(parts):
                rec[cuts[p]:cuts[p + 1]].tofile(f)
        for f in parts:
            f.close()

        # 2. count each partition (at min-count 1 first when sizing by coverage); results wait on disk
        def count_all(threshold: int) -> list[dict]:
            stages = []
            for p in range(len(parts)):
                rec = np.fromfile(tmp / f"part{p:04d}.bin", dtype=REC)
                stage = _count_partition(rec, tokens, doc_offsets, continuations, max_len, threshold, pad, tdt)
                del rec
                for name, arr in stage.items():
                    np.save(tmp / f"stage{threshold}_{p:04d}_{name}.npy", arr)
                stages.append({name: np.load(tmp / f"stage{threshold}_{p:04d}_{name}.npy", mmap_mode="r")
                               for name in stage})
            return stages

        floor = 1 if coverage is not None else min_count
        stages = count_all(floor)

        # 3. size from data: coverage of the validation split per threshold, pick the smallest table that reaches it
        vtokens = np.fromfile(tmp / "val.bin", dtype=tdt) if n_val else np.empty(0, tdt)
        curve = coverage_curve(stages, vtokens, val_offsets, orders, max_len, tdt, floor)
        if coverage is not None:
            if not curve:
                raise DraftheadsError("--coverage needs validation documents, but none were held out; "
                                      "raise --validation (fraction of documents) or pass --min-count instead")
            ok = [c for c in curve if c["coverage"] >= coverage]
            chosen = max(ok, key=lambda c: c["min_count"]) if ok else curve[0]
            if not ok:
                log(f"[draft_file] coverage {coverage} is not reachable (best {curve[0]['coverage']:.3f} at "
                    "min-count 1); using min-count 1")
            min_count = chosen["min_count"]
        selected = next((c for c in curve if c["min_count"] == min_count), None)
        if min_count != floor:  # the tries are cut at min-count: recount at the chosen one
            stages = count_all(min_count)
        t_count = time.perf_counter() - t0 - t_tok

        header = {
            "format": "draftheads draft file", "version": VERSION,
            "target": {"name": target_name, "vocab_size": vocab_size, "tokenizer_hash": tokenizer_hash(tokenizer)},
            "orders": list(orders), "continuations": continuations, "max_len": max_len, "min_count": min_count,
            "token_dtype": tdt.str, "sources": sources, "validation_fraction": validation,
            "validation": {"tokens": int(n_val), "curve": curve, "selected": selected},
        }
        stored = (tokens, doc_offsets, vtokens, val_offsets) if keep_corpus else None
        write_file(out, header, stages, stored, tdt, max_len)
    f = DraftFile(out)
    report = {"tokens": int(n_tokens), "validation_tokens": int(n_val), "keys": f.n_keys, "entries": f.n_entries,
              "file_bytes": f.header["file_bytes"], "table_bytes": f.header["table_bytes"], "min_count": min_count,
              "tokenize_s": round(t_tok, 2), "count_s": round(t_count, 2),
              "total_s": round(time.perf_counter() - t0, 2), "partitions": len(parts), "selected": selected}
    return report


def coverage_curve(stages, vtokens, val_offsets, orders, max_len, tdt, floor: int = 1,
                   max_positions: int = 200_000) -> list[dict]:
    """Per min-count threshold >= floor (the stages hold nothing below it): table size and, on validation
    positions, hit rate and coverage (the served key's best continuation starts with the right token)."""
    thresholds = [c for c in THRESHOLDS if c >= floor]
    # sizes are upper bounds: at a higher threshold some leaves are cut shorter and merge
    n_keys = np.array([[(s["counts"][_firsts(s), 0] >= c).sum() for s in stages] for c in thresholds]).sum(1)
    n_ent = np.array([sum(int((s["counts"][:, 0] >= c).sum()) for s in stages) for c in thresholds])
    entry_bytes = max_len * (tdt.itemsize + 4)
    sizes = n_keys * (8 + 1 + 4 + 8) + n_ent * entry_bytes
    offs = val_offsets.astype(np.int64)
    if len(vtokens) < 2:
        return []
    pos = np.arange(len(vtokens) - 1)
    doc = np.searchsorted(offs, pos, side="right") - 1
    pos = pos[pos + 1 < offs[doc + 1]]
    if len(pos) > max_positions:  # evenly spaced sample: deterministic
        pos = pos[np.linspace(0, len(pos) - 1, max_positions).astype(np.int64)]
    doc = np.searchsorted(offs, pos, side="right") - 1
    W = max(orders)
    idx = pos[:, None] - np.arange(W - 1, -1, -1)[None, :]  # [P, W] newest last
    ctx = np.where(idx >= offs[doc][:, None], vtokens[np.maximum(idx, 0)].astype(np.int64), -1)
    keys = context_keys(ctx, orders)  # [P, n_orders]
    truth = vtokens[pos + 1].astype(np.int64)
    top_count = np.zeros(keys.shape, dtype=np.int64)  # count of the key's best continuation (0 = key absent)
    top_right = np.zeros(keys.shape, dtype=bool)
    for s in stages:
        if not len(s["keys"]):
            continue
        first = _firsts(s)
        at = np.minimum(s["keys"].searchsorted(keys), len(s["keys"]) - 1)
        hit = (s["keys"][at] == keys) & (keys != 0)
        top_count = np.where(hit, s["counts"][first[at], 0], top_count)  # count of the most frequent first token
        top_right |= hit & (s["tokens"][first[at], 0].astype(np.int64) == truth[:, None])
    curve = []
    for i, c in enumerate(thresholds):
        live = top_count >= c  # [P, n_orders]
        served = np.where(live.any(1), len(orders) - 1 - np.argmax(live[:, ::-1], axis=1), -1)  # longest live order
        right = np.where(served >= 0, top_right[np.arange(len(pos)), np.maximum(served, 0)], False)
        per_order = {str(o): {"served": round(float((served == j).mean()), 4),
                              "right": round(float(right[served == j].mean()), 4) if (served == j).any() else 0.0}
                     for j, o in enumerate(orders)}
        curve.append({"min_count": c, "keys": int(n_keys[i]), "entries": int(n_ent[i]),
                      "table_bytes_bound": int(sizes[i]),  # the written table is smaller: leaves get cut and merge
                      "hit_rate": round(float((served >= 0).mean()), 4), "coverage": round(float(right.mean()), 4),
                      "per_order": per_order})
        if n_keys[i] == 0:
            break
    return curve


def _firsts(stage: dict) -> np.ndarray:
    """Index of each key's first (best) entry in a stage."""
    n = stage["n_entries"].astype(np.int64)
    return np.cumsum(n) - n


# ---------------------------------------------------------------------------------------------
# stats, inspect, CLI
# ---------------------------------------------------------------------------------------------
def stats(f: DraftFile) -> dict:
    """Entries, bytes and the validation coverage per order recorded at build time."""
    per_order = {str(o): {"keys": int((f.key_orders == o).sum())} for o in f.orders}
    sizes = np.diff(f.key_offsets.astype(np.int64))
    for o in f.orders:
        per_order[str(o)]["entries"] = int(sizes[f.key_orders == o].sum())
    h = f.header
    selected = h["validation"].get("selected") or {}
    for o, v in (selected.get("per_order") or {}).items():
        per_order[o].update(val_served=v["served"], val_right=v["right"])
    return {"path": str(f.path), "target": h["target"], "orders": h["orders"], "continuations": h["continuations"],
            "max_len": h["max_len"], "min_count": h["min_count"], "keys": f.n_keys, "entries": f.n_entries,
            "file_bytes": h["file_bytes"], "table_bytes": h["table_bytes"], "corpus_tokens": h["corpus_tokens"],
            "documents": h["documents"], "sources": h["sources"], "val_hit_rate": selected.get("hit_rate"),
            "val_coverage": selected.get("coverage"), "per_order": per_order}


def inspect(f: DraftFile, tokenizer, text: str) -> list[dict]:
    """The candidates the file returns after `text` (decoded), best first."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    c = f.lookup(ids)
    if c is None:
        return []
    return [{"order": c.order, "total": c.total, "count": int(n), "continuation": tokenizer.decode(row[:length].tolist()),
             "tokens": row[:length].tolist(), "confidences": [round(float(p), 4) for p in conf[:length]]}
            for row, n, length, conf in zip(c.tokens, c.counts, c.lengths, c.confidences)]


def load_tokenizer(name_or_path: str):
    """(tokenizer, target name, vocab size) of a target by built-in name or path, without loading its weights."""
    from models.target import TINY_TARGET, resolve_target_dir

    if name_or_path == TINY_TARGET:
        from models.tiny_tokenizer import tiny_byte_tokenizer

        tok = tiny_byte_tokenizer()
        return tok, name_or_path, len(tok)
    from transformers import AutoTokenizer

    p = Path(name_or_path).expanduser()
    name, path = (p.name, str(p)) if p.exists() else (name_or_path, None)
    directory = resolve_target_dir(name, path)
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    return AutoTokenizer.from_pretrained(directory, local_files_only=True), name, vocab


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m data.draft_file", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("build", "merge"):
        p = sub.add_parser(cmd)
        if cmd == "merge":
            p.add_argument("file", help="existing draft file (built with its corpus, the default)")
            p.add_argument("--min-count", type=int, default=None, help="default: the file's")
        else:
            p.add_argument("--orders", default="1,2,3,4")
            p.add_argument("--continuations", type=int, default=4)
            p.add_argument("--max-len", type=int, default=8)
            p.add_argument("--min-count", type=int, default=2)
            p.add_argument("--no-corpus", action="store_true", help="serving-only file (smaller; cannot be merged)")
        p.add_argument("--corpus", nargs="+", required=(cmd == "build"), default=[],
                       help="JSONL chats/prompts, ShareGPT .json, text/code directories")
        p.add_argument("--target", default="smollm2-135m-instruct", help="built-in target name or model path")
        p.add_argument("--coverage", type=float, default=None, help="pick min-count for this validation coverage")
        p.add_argument("--validation", type=float, default=0.02, help="fraction of documents held out")
        p.add_argument("--memory-mb", type=int, default=1024)
        p.add_argument("--out", required=True)
    p = sub.add_parser("stats")
    p.add_argument("file")
    p = sub.add_parser("inspect")
    p.add_argument("file")
    p.add_argument("--text", required=True)
    p.add_argument("--target", default="smollm2-135m-instruct")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "stats":
            print(json.dumps(stats(DraftFile(args.file))))
            return
        tokenizer, name, vocab = load_tokenizer(args.target)
        if args.cmd == "inspect":
            f = DraftFile(args.file)
            f.check_tokenizer(tokenizer)
            for row in inspect(f, tokenizer, args.text):
                print(json.dumps(row, ensure_ascii=False))
            return
        if args.cmd == "build":
            report = build(args.corpus, tokenizer, args.out, target_name=name, vocab_size=vocab,
                           orders=[int(o) for o in args.orders.split(",")], continuations=args.continuations,
                           max_len=args.max_len, min_count=args.min_count, coverage=args.coverage,
                           validation=args.validation, keep_corpus=not args.no_corpus, memory_mb=args.memory_mb)
        else:
            report = merge(DraftFile(args.file), args.corpus, tokenizer, args.out, min_count=args.min_count,
                           coverage=args.coverage, validation=args.validation, memory_mb=args.memory_mb)
        print(json.dumps(report))
    except DraftheadsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def merge(base: DraftFile, corpus: list[str], tokenizer, out: str | Path, min_count: int | None = None,
          coverage: float | None = None, validation: float | None = None, memory_mb: int = 1024,
) -> dict:
    """Add a corpus to an existing file: equals build(base's corpora + corpus) with the base's settings."""
    h = base.header
    base.check_tokenizer(tokenizer)
    if h["corpus_tokens"] == 0:
        raise DraftheadsError(f"draft file '{base.path}' was built with --no-corpus, so it cannot be merged exactly; "
                              "rebuild it from its corpora without --no-corpus")
    return build(corpus, tokenizer, out, target_name=h["target"]["name"], vocab_size=h["target"]["vocab_size"],
                 orders=h["orders"], continuations=h["continuations"], max_len=h["max_len"],
                 min_count=min_count or h["min_count"], coverage=coverage,
                 validation=h["validation_fraction"] if validation is None else validation,
                 memory_mb=memory_mb, base=base)


if __name__ == "__main__":
    main()