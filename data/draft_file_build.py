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

A build streams, with `--threads` workers and a progress bar (with an ETA) per step:
1. tokenize: documents are read in batches and encoded by the fast tokenizer's batch encoder (Rust threads,
   GIL released) while the next batch is read, a long document in pieces (_pieces: the same ids); each is
   appended to the stored corpus and to a token stream, PAD between documents, that windows are read from.
2. partition: the window starts are spilled to group files by first token, packed into sort partitions of
   at most FINE_WINDOWS. A first token with more windows is spread over several partitions by a hash of the
   second token (a token pair is never split); its order-1 key is counted in pieces and joined
   (data.draft_file_count.join_pieces).
3. count: workers sort and count each group's partitions (data/draft_file_count.py); a group's entries go
   to a run file sorted by key.
4. write: the runs are merged a key range at a time into the file, then checksummed.
With `--coverage` step 3 runs twice: at min-count 1 for the validation curve alone (the sorted windows kept
on disk), then at the chosen min-count.

Memory: `--memory-mb` bounds what steps 3 and 4 hold (a group per worker, a merge chunk); the tokenizer adds
what its batches and the longest document take, and the process what Python and the tokenizer keep. Only the
validation split (held in memory, 2% of the tokens by default) and 8 bytes a document grow with the corpus.
Disk, besides the file: the corpus twice (2 bytes a token each), 8 bytes a window, the runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from data.draft_file import U64, VERSION, DraftFile, context_keys, take_rows, token_dtype, write_file
from data.draft_file_count import ENTRY_FIELDS, WindowSpec, count_sorted, join_pieces, select_keys, sort_windows
from models.errors import DraftheadsError

THRESHOLDS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)
FINE_WINDOWS = 1 << 18  # windows sorted at once: the sort and the count slow down once they leave the cache
# Memory model (what --memory-mb bounds). A group's worker holds its spilled windows (16 B each with the sort
# order) and, twice while sorting them by key, the group's count: at most ~1 key and 1.5 entries per window
# (min-count 1; far fewer above). The merge holds a chunk of entries twice (gathered, then reordered).
def _group_bytes_per_window(spec: WindowSpec) -> int:
    return 16 + 2 * (17 + 3 * _entry_bytes(spec) // 2)


def _merge_bytes_per_entry(spec: WindowSpec) -> int:
    return 2 * (_entry_bytes(spec) + 17) + 24


def _entry_bytes(spec: WindowSpec) -> int:  # tokens and prefix counts of one entry, and its rank tie-breaker
    return spec.max_len * (spec.tdt.itemsize + 4) + 4


MAX_GROUPS = 512  # spill files open at once
MERGE_CHUNK_BYTES = 1 << 27  # a merge step's memory (two in flight): larger steps are not faster
RUN_BUCKET_BITS = 12  # a run's keys are indexed by their top bits, so a merge step reads a bucket range
BATCH_CHARS = 1 << 20  # characters per tokenizer batch (two in flight: their encodings are ~100 B a token)
STREAM_CHUNK = 1 << 20  # tokens per step when scanning the token stream (~60 B a token of temporaries)


# ---------------------------------------------------------------------------------------------
# 1. tokenizing
# ---------------------------------------------------------------------------------------------
PIECE_CHARS = 1 << 16  # a longer document is encoded in pieces: bounded tokenizer memory, balanced threads
PIECE_CUT = re.compile(r"(?<=.)(?=\n\S)", re.S)  # before a newline that ends a whitespace run and starts a line
PROBE = ("import os\n\n\nclass A(B):\n    def f(self, x=1):  # note\n        return {'a': [x, 2.5e-3]}\n\n"
         "Hello, world! It's 12345 o'clock.\nWie geht's? Ça va. 中文文本。\n\tTabbed\nend;\r\nnext  \n\nx\n"
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n- item\n#include <x>\n}\n@decorator\n")


def _pieces(text: str) -> list[str]:
    """A long text cut every ~PIECE_CHARS before a newline that ends a whitespace run and starts a line. A GPT-2
    style pre-tokenizer makes that newline a piece of its own, and the run before it (cut or not) another, so
    the tokens do not change."""
    if len(text) <= PIECE_CHARS:
        return [text]
    cuts, at = [0], PIECE_CHARS
    while at < len(text) and (m := PIECE_CUT.search(text, at)):
        cuts.append(m.start())
        at = m.start() + PIECE_CHARS
    return [text[a:b] for a, b in zip(cuts, cuts[1:] + [len(text)])]


def _encoder(tokenizer):
    """texts -> token id lists, through the fast tokenizer's batch encoder when there is one (no offsets kept),
    long documents in pieces when the tokenizer gives the same ids for PROBE cut at every PIECE_CUT (a prefix
    space, a normalizer or an added token spanning a newline would not)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]
    if backend.truncation is not None or backend.padding is not None:  # transformers turns these off per call
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(backend.to_str())
        backend.no_truncation()
        backend.no_padding()
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)

    def whole(texts):  # at most BATCH_CHARS at once: the encoder's own objects take ~100 B a character
        ids, at = [], 0
        while at < len(texts):
            size, end = 0, at
            while end < len(texts) and (end == at or size + len(texts[end]) <= BATCH_CHARS):
                size, end = size + len(texts[end]), end + 1
            ids += [e.ids for e in encode_batch(texts[at:end], add_special_tokens=False)]
            at = end
        return ids

    cuts = [0] + [m.start() for m in PIECE_CUT.finditer(PROBE)] + [len(PROBE)]
    pieces = [PROBE[a:b] for a, b in zip(cuts, cuts[1:])]
    added = [t.content for t in backend.get_added_tokens_decoder().values()]
    if sum(whole(pieces), []) != whole([PROBE])[0] or any("\n" in t for t in added):
        return whole

    def in_pieces(texts):
        split = [_pieces(t) for t in texts]
        ids = iter(whole([p for ps in split for p in ps]))
        return [next(ids) if len(ps) == 1 else list(itertools.chain.from_iterable(next(ids) for _ in ps))
                for ps in split]

    return in_pieces


def iter_token_batches(paths: Iterable[str], tokenizer, batch_chars: int = BATCH_CHARS) -> Iterator[list]:
    """[(token ids, text)] per batch of documents of every corpus path, in order; a batch is read while the one
    before is encoded."""
    from data.readers import iter_documents

    encode = _encoder(tokenizer)

    def batches():
        batch, size = [], 0
        for path in paths:
            for text in iter_documents(path, tokenizer):
                batch.append(text)
                size += len(text)
                if size >= batch_chars:
                    yield batch
                    batch, size = [], 0
        if batch:
            yield batch

    def done(job):
        ids, texts = job[0].result(), job[1]
        lens = [len(i) for i in ids]
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=sum(lens))
        return list(zip(np.split(flat, np.cumsum(lens)[:-1]), texts))

    with ThreadPoolExecutor(1) as pool:
        pending = None
        for texts in batches():
            job = (pool.submit(encode, texts), texts)
            if pending is not None:
                yield done(pending)
            pending = job
        if pending is not None:
            yield done(pending)


def is_validation(text: str | bytes, fraction: float) -> bool:
    """Held-out split by content hash: independent of corpus order, batching and merging."""
    data = text.encode() if isinstance(text, str) else text
    return fraction > 0 and zlib.crc32(data) % 10_000 < fraction * 10_000


class _Documents:
    """Documents as counted: tokens and offsets (what the file stores) and, given a window spec, the big-endian
    token stream windows are read from (spec.gap PAD after each document) with windows per first token."""

    def __init__(self, path: Path, tdt: np.dtype, spec: WindowSpec | None = None, vocab_size: int = 0):
        self.path, self.tdt, self.spec = path, tdt, spec
        self.f = open(path, "wb")
        self.stream = open(path.with_suffix(".stream"), "wb") if spec else None
        self.ends, self.n = [np.zeros(1, np.int64)], 0
        self.first = np.zeros(vocab_size, np.int64)  # windows (positions followed by a token) per first token

    def add(self, docs: list[np.ndarray]) -> None:
        docs = [d for d in docs if len(d)]
        if not docs:
            return
        lens = np.array([len(d) for d in docs])
        flat = np.concatenate(docs, dtype=self.tdt, casting="unsafe")  # ids were checked against the vocabulary
        flat.tofile(self.f)
        ends = np.cumsum(lens)
        self.ends.append(self.n + ends)
        self.n += int(ends[-1])
        if self.stream is not None:
            out = np.full(len(flat) + len(docs) * self.spec.gap, self.spec.pad, self.tdt.newbyteorder(">"))
            out[np.arange(len(flat)) + np.repeat(np.arange(len(docs)) * self.spec.gap, lens)] = flat
            out.tofile(self.stream)
            starts = np.ones(len(flat), bool)
            starts[ends - 1] = False  # a document's last token has nothing after it
            self.first += np.bincount(flat[starts], minlength=len(self.first))

    def close(self) -> tuple[int, np.ndarray]:
        self.f.close()
        if self.stream is not None:
            self.stream.close()
        return self.n, np.concatenate(self.ends).astype(np.uint64)

    def tokens(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.tdt, mode="r", shape=(self.n,)) if self.n else np.empty(0, self.tdt)


# ---------------------------------------------------------------------------------------------
# 2.-4. partitioning, counting, merging
# ---------------------------------------------------------------------------------------------
class _Counter:
    """Counts the windows of one token stream: partition plan, spill to group files, count passes, run merge."""

    def __init__(self, tmp: Path, docs: _Documents, spec: WindowSpec, memory_bytes: int, threads: int, log):
        self.tmp, self.spec, self.threads, self.memory = tmp, spec, threads, memory_bytes
        self.first = docs.first
        self.stream = np.memmap(docs.path.with_suffix(".stream"), dtype=spec.tdt.newbyteorder(">"), mode="r")
        # element s packs tokens s.. of the stream into one big-endian uint64 (strides of one token)
        self.view = np.ndarray((len(self.stream) - spec.per_word + 1,), ">u8", self.stream,
                               strides=(spec.tdt.itemsize,))
        if len(self.stream) >= 1 << 40:
            raise DraftheadsError(f"draft file build: {len(self.stream):,} tokens are more than one build takes "
                                  "(2^40); split the corpus and merge")
        self.windows = int(self.first.sum())
        capacity = max(1, memory_bytes // threads // _group_bytes_per_window(spec))  # windows one worker holds
        self.fine = min(FINE_WINDOWS, capacity)
        self._plan(max(capacity, -(-self.windows // MAX_GROUPS)))
        spread = np.flatnonzero(self.pieces > 1)
        self.spread = len(spread) > 0
        self.spread_totals = {}  # order-1 key of each spread first token -> its occurrences
        if 1 in spec.orders and len(spread):
            keys = context_keys(spread[:, None], (1,))[:, 0]
            self.spread_totals = {int(k): int(self.first[t]) for k, t in zip(keys, spread)}
        self.spread_keys = np.array(sorted(self.spread_totals), dtype=U64)
        log(f"[draft_file] {self.windows:,} windows in {self.n_parts} partitions, {self.n_groups} groups, "
            f"{len(spread)} first tokens spread over several")

    def _plan(self, capacity: int) -> None:
        """Partition of a window = base[first token] + hash(second token) % pieces[first token]: first tokens are
        packed in order into partitions of <= fine windows, one with more gets `pieces` partitions of its own.
        Consecutive partitions form a group (one spill file, counted by one worker) of <= capacity windows."""
        self.pieces = np.maximum(1, -(-self.first // self.fine))
        self.base = np.zeros(len(self.first), np.int64)
        sizes, fill = [], 0
        for t in np.flatnonzero(self.first):
            c, p = int(self.first[t]), int(self.pieces[t])
            if fill and (p > 1 or fill + c > self.fine):
                sizes.append(fill)
                fill = 0
            self.base[t] = len(sizes)
            if p > 1:
                sizes += [c / p] * p
            else:
                fill += c
        if fill or not sizes:
            sizes.append(fill)
        self.n_parts = len(sizes)
        self.group_of, g, acc, start = np.zeros(len(sizes), np.int64), 0, 0, 0
        for i, size in enumerate(sizes):
            if acc and (acc + size > capacity or i - start == 1 << 16):  # partition ids in a group are uint16
                g, acc, start = g + 1, 0, i
            self.group_of[i], acc = g, acc + size
        self.n_groups = g + 1

    def _part_of(self, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        part = self.base[first]
        at = np.flatnonzero(self.pieces[first] > 1) if self.spread else first[:0]
        if len(at):  # a spread first token: its second token's hash picks the piece
            spread = ((second[at].astype(U64) * U64(0x9E3779B97F4A7C15)) >> U64(40)).astype(np.int64)  # 24 bits
            part[at] += (spread * self.pieces[first[at]]) >> 24  # in [0, pieces): no division
        return part

    def _path(self, g: int, what: str) -> Path:
        return self.tmp / f"group{g:04d}.{what}"

    def spill(self) -> None:
        """Window starts (positions followed by a token of their document) to their group's file, in order, each
        as one uint64: its partition within the group << 40 | its position."""
        files = [open(self._path(g, "pos"), "wb") for g in range(self.n_groups)]
        n, pad = len(self.stream), self.spec.pad
        first_part = np.searchsorted(self.group_of, np.arange(self.n_groups))  # a group's first partition
        for a in range(0, n - 1, STREAM_CHUNK):
            chunk = self.stream[a: a + STREAM_CHUNK + 1].astype(self.spec.tdt)
            s = np.flatnonzero((chunk[:-1] != pad) & (chunk[1:] != pad))
            part = self._part_of(chunk[s].astype(np.intp), chunk[s + 1])
            group = self.group_of[part]
            rec = ((part - first_part[group]) << 40 | (s + a)).astype(U64)
            if self.n_groups == 1:
                rec.tofile(files[0])
                continue
            order = np.argsort(group.astype(np.uint16), kind="stable")
            bounds = np.r_[0, np.cumsum(np.bincount(group, minlength=self.n_groups))]
            rec = rec[order]
            for g in np.flatnonzero(np.diff(bounds)):
                rec[bounds[g]: bounds[g + 1]].tofile(files[g])
        for f in files:
            f.close()

    def count(self, min_count: int, entries: bool, validation: _Validation | None, sorted_io: str | None,
              progress) -> list[dict]:
        """One pass over the groups (`threads` at a time): the runs (when entries), the pieces of spread order-1
        keys joined into one more; validation statistics accumulate in `validation`. sorted_io: "save" keeps
        each group's sorted windows on disk for a later pass, "load" reads them instead of sorting again."""
        runs, pieces = [], []
        with ThreadPoolExecutor(self.threads) as pool:
            work = pool.map(lambda g: self._count_group(g, min_count, entries, validation, sorted_io),
                            range(self.n_groups))
            for res in work:
                progress.update(res["windows"])
                if res["run"] is not None:
                    runs.append(res["run"])
                if res["pieces"] is not None:
                    pieces.append(res["pieces"])
                if validation is not None:
                    validation.add(res["stats"])
        joined = join_pieces(pieces, self.spread_totals, self.spec.continuations) if pieces else None
        if joined is not None:
            if validation is not None:
                validation.add(validation.measure(joined))
            if entries:
                runs.append(_sorted_run(joined))
        return runs

    def _count_group(self, g: int, min_count: int, entries: bool, validation, sorted_io) -> dict:
        rec = np.fromfile(self._path(g, "pos"), dtype=U64)
        if sorted_io == "load":
            parts = _load_sorted(self._path(g, "sorted"), self.spec)
        else:
            part = (rec >> U64(40)).astype(np.uint16)
            order = np.argsort(part, kind="stable")  # positions stay ascending in a partition: near-sequential reads
            pos = (rec & U64((1 << 40) - 1)).astype(np.int64)
            cuts = np.flatnonzero(np.diff(part[order])) + 1
            parts = (sort_windows(self.view, pos[chunk], self.spec) for chunk in np.split(order, cuts))
        saved = open(self._path(g, "sorted"), "wb") if sorted_io == "save" else None
        outs = []
        for words, lcp in parts:
            if saved is not None:
                np.array([len(lcp)], np.int64).tofile(saved)
                for w in words + [lcp, np.zeros(-len(lcp) % 8, np.uint8)]:  # 8-byte aligned for the next one
                    w.tofile(saved)
            outs.append(count_sorted(words, lcp, self.spec, min_count, entries))
        if saved is not None:
            saved.close()
        out = {name: np.concatenate([o[name] for o in outs]) for name in outs[0]} if outs else None
        del outs
        if out is None:
            return {"windows": 0, "run": None, "pieces": None, "stats": None}
        spread = np.zeros(len(out["keys"]), bool)
        one = np.flatnonzero(out["orders"] == 1)  # only order-1 keys are counted in pieces
        spread[one] = np.isin(out["keys"][one], self.spread_keys)
        pieces = select_keys(out, spread) if spread.any() else None
        out = select_keys(out, ~spread) if pieces is not None else out
        run = None
        if entries:  # the rank tie-breaker is only needed to join pieces
            run = _save_run(_sorted_run({k: v for k, v in out.items() if k != "second"}), self._path(g, "run"))
        return {"windows": len(rec), "run": run, "pieces": pieces,
                "stats": validation.measure(out) if validation is not None else None}

    def merged(self, runs: list[dict]) -> Iterator[dict]:
        """All runs' keys in key order, a range of buckets at a time (as much as the memory budget holds)."""
        per_bucket = sum(np.diff(r["entry_bounds"]) for r in runs)
        limit = max(1, min(self.memory, MERGE_CHUNK_BYTES) // _merge_bytes_per_entry(self.spec))
        b0 = 0
        while b0 < len(per_bucket):
            b1 = b0 + max(1, int(np.searchsorted(np.cumsum(per_bucket[b0:]), limit, side="right")))
            parts = [_bucket_range(r, b0, b1) for r in runs]
            cat = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
            order = np.argsort(cat["keys"], kind="stable")
            ent = _entries_of(order, cat["n_entries"])
            yield {name: take_rows(a, ent) if name in ENTRY_FIELDS else a[order] for name, a in cat.items()}
            b0 = b1


def _entries_of(order: np.ndarray, n_entries: np.ndarray) -> np.ndarray:
    """Entry indices of the keys taken in `order` (a key's entries are consecutive): each taken key's source
    range, concatenated, as a cumulative sum of steps (1 inside a range, a jump between ranges)."""
    n = n_entries.astype(np.int64)
    start, taken = (np.cumsum(n) - n)[order], n[order]
    keep = taken > 0
    start, taken = start[keep], taken[keep]
    steps = np.ones(int(taken.sum()), np.int64)
    if len(steps):
        at = np.cumsum(taken) - taken  # where each range begins in the output
        steps[at] = start - np.r_[0, (start + taken - 1)[:-1]]
    return np.cumsum(steps)


def _sorted_run(out: dict) -> dict:
    """A count's keys sorted, with the bounds of each key bucket (top RUN_BUCKET_BITS bits) in keys and entries."""
    order = np.argsort(out["keys"], kind="stable")
    ent = _entries_of(order, out["n_entries"])
    run = {name: take_rows(a, ent) if name in ENTRY_FIELDS else a[order] for name, a in out.items()}
    edges = np.arange((1 << RUN_BUCKET_BITS) + 1, dtype=np.float64) * 2.0 ** (64 - RUN_BUCKET_BITS)
    run["key_bounds"] = np.r_[np.searchsorted(run["keys"], edges[:-1].astype(U64)), len(order)]
    run["entry_bounds"] = np.r_[0, np.cumsum(run["n_entries"], dtype=np.int64)][run["key_bounds"]]
    return run


def _save_run(run: dict, directory: Path) -> dict:
    """Arrays to .npy files, read back memory-mapped (the bounds stay in memory)."""
    directory.mkdir()
    for name, a in run.items():
        if name not in ("key_bounds", "entry_bounds"):
            np.save(directory / f"{name}.npy", a)
            run[name] = np.load(directory / f"{name}.npy", mmap_mode="r")
    return run


def _bucket_range(run: dict, b0: int, b1: int) -> dict:
    k0, k1 = run["key_bounds"][b0], run["key_bounds"][b1]
    e0, e1 = run["entry_bounds"][b0], run["entry_bounds"][b1]
    return {name: np.asarray(a[e0:e1] if name in ENTRY_FIELDS else a[k0:k1]) for name, a in run.items()
            if name not in ("key_bounds", "entry_bounds")}


def _load_sorted(path: Path, spec: WindowSpec) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
    """The (words, lcp) of each partition as a save pass wrote them: a length, the words, the lcp bytes."""
    raw, at = np.memmap(path, dtype=np.uint8, mode="r"), 0
    while at < len(raw):
        n = int(raw[at: at + 8].view(np.int64)[0])
        at += 8
        words = [np.asarray(raw[at + 8 * n * i: at + 8 * n * (i + 1)].view(np.uint64)) for i in range(spec.n_words)]
        at += 8 * n * spec.n_words
        yield words, np.asarray(raw[at: at + n])
        at += n + (-n % 8)


class _Validation:
    """What the coverage curve needs, accumulated over counted keys: keys and entries per min-count threshold
    (by the count of their first token) and, for each held-out context's key, the count and first token of its
    best entry. Positions: an even sample of the validation split (deterministic)."""

    def __init__(self, vtokens: np.ndarray, val_offsets: np.ndarray, orders, floor: int, max_positions: int = 200_000):
        self.thresholds = np.array([c for c in THRESHOLDS if c >= floor])
        self.keys_at = np.zeros(len(self.thresholds) + 1, np.int64)  # keys by how many thresholds they pass
        self.entries_at = np.zeros(len(self.thresholds) + 1, np.int64)
        offs = val_offsets.astype(np.int64)
        pos = np.arange(max(len(vtokens) - 1, 0))
        pos = pos[pos + 1 < offs[np.searchsorted(offs, pos, side="right")]] if len(pos) else pos
        if len(pos) > max_positions:
            pos = pos[np.linspace(0, len(pos) - 1, max_positions).astype(np.int64)]
        doc = np.searchsorted(offs, pos, side="right") - 1
        W = max(orders)
        idx = pos[:, None] - np.arange(W - 1, -1, -1)[None, :]  # [P, W] newest last
        ctx = np.where(idx >= offs[doc][:, None], vtokens[np.maximum(idx, 0)].astype(np.int64), -1)
        self.keys = context_keys(ctx, orders) if len(pos) else np.zeros((0, len(orders)), U64)  # [P, n_orders]
        self.truth = vtokens[pos + 1].astype(np.int64)
        self.wanted = np.unique(self.keys[self.keys != 0])
        self.mark = np.zeros(1 << 20, bool)  # cheap first test: does any wanted key have these top 20 bits?
        self.mark[(self.wanted >> U64(44)).astype(np.intp)] = True
        self.best_count = np.zeros(len(self.wanted), np.int64)
        self.best_token = np.full(len(self.wanted), -1, np.int64)

    def measure(self, out: dict) -> dict:
        """This count's share (a worker computes it; add() folds it in)."""
        n = out["n_entries"].astype(np.int64)
        c0 = out["counts"][:, 0].astype(np.int64)
        best = c0[np.cumsum(n) - n]  # the first entry of a key has its most frequent first token
        cand = np.flatnonzero(self.mark[(out["keys"] >> U64(44)).astype(np.intp)]) if len(self.wanted) else n[:0]
        at = np.minimum(np.searchsorted(self.wanted, out["keys"][cand]), max(len(self.wanted) - 1, 0))
        ok = self.wanted[at] == out["keys"][cand] if len(cand) else np.zeros(0, bool)
        hit, at = cand[ok], at[ok]
        passed = lambda counts: np.searchsorted(self.thresholds, counts, side="right")  # noqa: E731
        return {"keys_at": np.bincount(passed(best), minlength=len(self.keys_at)),
                "entries_at": np.bincount(passed(c0), minlength=len(self.entries_at)),
                "at": at, "count": best[hit], "token": out["tokens"][(np.cumsum(n) - n)[hit], 0].astype(np.int64)}

    def add(self, share: dict) -> None:
        self.keys_at += share["keys_at"]
        self.entries_at += share["entries_at"]
        self.best_count[share["at"]] = share["count"]
        self.best_token[share["at"]] = share["token"]

    def curve(self, orders, max_len: int, tdt: np.dtype) -> list[dict]:
        """Per min-count threshold: table size and, on the validation positions, hit rate and coverage (the
        served key's best continuation starts with the right token)."""
        if not len(self.truth):
            return []
        at_least = lambda hist: hist[::-1].cumsum()[::-1][1:]  # noqa: E731  [thresholds]: counts >= each
        n_keys, n_ent = at_least(self.keys_at), at_least(self.entries_at)
        sizes = n_keys * (8 + 1 + 4 + 8) + n_ent * max_len * (tdt.itemsize + 4)
        at = np.minimum(np.searchsorted(self.wanted, self.keys), max(len(self.wanted) - 1, 0))
        present = (self.keys != 0) & (self.wanted[at] == self.keys) if len(self.wanted) else self.keys != 0
        top_count = np.where(present, self.best_count[at], 0) if len(self.wanted) else np.zeros(self.keys.shape, int)
        top_right = present & (self.best_token[at] == self.truth[:, None]) if len(self.wanted) else present
        curve = []
        for i, c in enumerate(self.thresholds):
            live = top_count >= c  # [P, n_orders]
            served = np.where(live.any(1), len(orders) - 1 - np.argmax(live[:, ::-1], axis=1), -1)  # longest live
            right = np.where(served >= 0, top_right[np.arange(len(served)), np.maximum(served, 0)], False)
            per_order = {str(o): {"served": round(float((served == j).mean()), 4),
                                  "right": round(float(right[served == j].mean()), 4) if (served == j).any() else 0.0}
                         for j, o in enumerate(orders)}
            curve.append({"min_count": int(c), "keys": int(n_keys[i]), "entries": int(n_ent[i]),
                          "table_bytes_bound": int(sizes[i]),  # the written table is smaller: leaves get cut and merge
                          "hit_rate": round(float((served >= 0).mean()), 4), "coverage": round(float(right.mean()), 4),
                          "per_order": per_order})
            if n_keys[i] == 0:
                break
        return curve


# ---------------------------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------------------------
def build(corpus: list[str] | None, tokenizer, out: str | Path, *, target_name: str, vocab_size: int,
          orders=(1, 2, 3, 4), continuations: int = 4, max_len: int = 8, min_count: int = 2,
          coverage: float | None = None, validation: float = 0.02, keep_corpus: bool = True,
          memory_mb: int = 1024, threads: int | None = None, base: DraftFile | None = None,
          token_docs: Iterable | None = None, progress: bool | None = None, log=print) -> dict:
    """Build a draft file from corpora (and `base`'s stored corpus first, for merge); returns the build report.

    `token_docs`: documents already tokenized (e.g. regenerated outputs as id lists), counted after the corpora.
    `threads`: workers (default: the CPUs this process may use); RAYON_NUM_THREADS, when set, sizes the
    tokenizer's own pool. `progress`: bars on stderr (default: when stderr is a terminal)."""
    from tqdm import tqdm

    from models.target import tokenizer_hash

    t0, cpu0 = time.perf_counter(), time.process_time()
    orders = tuple(sorted(int(o) for o in orders))
    if not orders or orders[0] < 1 or continuations < 1 or max_len < 1 or min_count < 1:
        raise DraftheadsError(f"draft file build needs orders >= 1, continuations >= 1, max-len >= 1, min-count >= 1; "
                              f"got orders={orders}, continuations={continuations}, max-len={max_len}, min-count={min_count}")
    threads = threads or len(os.sched_getaffinity(0))
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))  # read when the tokenizer's pool starts
    progress = sys.stderr.isatty() if progress is None else progress
    bar = lambda **kw: tqdm(disable=not progress, dynamic_ncols=True, leave=False, **kw)  # noqa: E731
    tdt = token_dtype(vocab_size)
    spec = WindowSpec(orders, continuations, max_len, tdt)
    memory = max(int(memory_mb * 2**20), 1 << 16)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".dfl-build-") as tmp:
        tmp = Path(tmp)
        docs, val = _Documents(tmp / "corpus.bin", tdt, spec, vocab_size), _Documents(tmp / "val.bin", tdt)
        sources = list(base.header["sources"]) if base is not None else []
        if base is not None:  # stored corpus first, so merge(build(A), B) sees exactly build(A + B)'s token stream
            for sink, toks, offs in ((docs, base.corpus_tokens, base.doc_offsets),
                                     (val, base.val_tokens, base.val_offsets)):
                offs = offs.astype(np.int64)
                for a in range(0, len(offs) - 1, 4096):
                    sink.add([np.asarray(toks[x:y]) for x, y in zip(offs[a: a + 4096], offs[a + 1: a + 4097])])
        pretokenized = [[(np.asarray(d, dtype=np.int64), None) for d in token_docs]] if token_docs else []
        with bar(total=_corpus_chars(corpus or []), unit="char", unit_scale=True, desc="tokenize") as pbar:
            for batch in (*iter_token_batches(corpus or [], tokenizer), *pretokenized):
                ids = [i for i, _ in batch]
                top = max((int(i.max()) for i in ids if len(i)), default=-1)
                if top >= vocab_size:
                    raise DraftheadsError(f"tokenizer produced id {top} >= vocab size {vocab_size}; "
                                          "pass the target whose tokenizer this is (--target)")
                held = [is_validation(text if text is not None else i.tobytes(), validation) for i, text in batch]
                docs.add([i for i, h in zip(ids, held) if not h])
                val.add([i for i, h in zip(ids, held) if h])
                pbar.update(sum(len(text) for _, text in batch if text is not None))
                pbar.set_postfix(tokens=f"{docs.n + val.n:,}")
        sources += [str(p) for p in corpus or []]
        n_tokens, doc_offsets = docs.close()
        n_val, val_offsets = val.close()
        if n_tokens == 0:
            raise DraftheadsError(f"corpus {list(corpus or [])} produced no tokens to count (empty, unreadable or all "
                                  "held out for validation); pass non-empty text / JSONL / code directories")
        t_tok = time.perf_counter() - t0
        log(f"[draft_file] tokenized {n_tokens + n_val:,} tokens in {t_tok:.1f}s")

        counter = _Counter(tmp, docs, spec, memory, threads, log)
        counter.spill()
        log(f"[draft_file] spilled window starts in {time.perf_counter() - t0 - t_tok:.1f}s")
        vtokens = np.fromfile(val.path, dtype=tdt) if n_val else np.empty(0, tdt)
        floor = 1 if coverage is not None else min_count
        stats = _Validation(vtokens, val_offsets, orders, floor)
        if coverage is not None and not len(stats.truth):
            raise DraftheadsError("--coverage needs validation documents, but none were held out; "
                                  "raise --validation (fraction of documents) or pass --min-count instead")

        def count(threshold, entries, measure, sorted_io):
            t = time.perf_counter()
            with bar(total=counter.windows, unit="window", unit_scale=True, desc=f"count min-count {threshold}") as pb:
                runs = counter.count(threshold, entries, measure, sorted_io, pb)
            log(f"[draft_file] counted at min-count {threshold} in {time.perf_counter() - t:.1f}s")
            return runs

        runs = count(floor, coverage is None, stats, "save" if coverage is not None else None)
        curve = stats.curve(orders, max_len, tdt)
        if coverage is not None:  # size from data: the smallest table that reaches the coverage, counted again
            ok = [c for c in curve if c["coverage"] >= coverage]
            if not ok:
                log(f"[draft_file] coverage {coverage} is not reachable (best {curve[0]['coverage']:.3f} at "
                    "min-count 1); using min-count 1")
            min_count = max(ok, key=lambda c: c["min_count"])["min_count"] if ok else curve[0]["min_count"]
            runs = count(min_count, True, None, "load")
        selected = next((c for c in curve if c["min_count"] == min_count), None)
        t_count = time.perf_counter() - t0 - t_tok

        header = {
            "format": "draftheads draft file", "version": VERSION,
            "target": {"name": target_name, "vocab_size": vocab_size, "tokenizer_hash": tokenizer_hash(tokenizer)},
            "orders": list(orders), "continuations": continuations, "max_len": max_len, "min_count": min_count,
            "token_dtype": tdt.str, "sources": sources, "validation_fraction": validation,
            "validation": {"tokens": int(n_val), "curve": curve, "selected": selected},
        }
        stored = (docs.tokens(), doc_offsets, vtokens, val_offsets) if keep_corpus else None
        K = sum(int(r["key_bounds"][-1]) for r in runs)
        E = sum(int(r["entry_bounds"][-1]) for r in runs)
        with bar(total=K, unit="key", unit_scale=True, desc="write") as pbar:
            write_file(out, header, _counted(counter.merged(runs), pbar), K, E, stored, tdt, max_len)
    f = DraftFile(out, verify=False)
    return {"tokens": int(n_tokens), "validation_tokens": int(n_val), "keys": f.n_keys, "entries": f.n_entries,
            "file_bytes": f.header["file_bytes"], "table_bytes": f.header["table_bytes"], "min_count": min_count,
            "tokenize_s": round(t_tok, 2), "count_s": round(t_count, 2),
            "write_s": round(time.perf_counter() - t0 - t_tok - t_count, 2), "total_s": round(time.perf_counter() - t0, 2),
            "cpu_s": round(time.process_time() - cpu0, 2),  # all threads: the work, whatever else ran on the CPUs
            "threads": threads, "partitions": counter.n_parts, "groups": counter.n_groups,
            "spread_first_tokens": int((counter.pieces > 1).sum()), "selected": selected}


def _counted(chunks: Iterator[dict], pbar) -> Iterator[dict]:
    """The merged chunks, the next one prepared on a thread while this one is written."""
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(next, chunks, None)
        while (c := job.result()) is not None:
            job = pool.submit(next, chunks, None)
            pbar.update(len(c["keys"]))
            yield c


def _corpus_chars(paths: list[str]) -> int:
    """Bytes of the corpus files (the progress bar's total: characters of text, roughly)."""
    from data.readers import TEXT_SUFFIXES

    total = 0
    for p in map(Path, paths):
        files = (f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES) if p.is_dir() else [p] if p.exists() else []
        total += sum(f.stat().st_size for f in files if f.is_file())
    return total


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
        p.add_argument("--threads", type=int, default=None, help="workers (default: the CPUs available)")
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
                           validation=args.validation, keep_corpus=not args.no_corpus, memory_mb=args.memory_mb,
                           threads=args.threads)
        else:
            report = merge(DraftFile(args.file), args.corpus, tokenizer, args.out, min_count=args.min_count,
                           coverage=args.coverage, validation=args.validation, memory_mb=args.memory_mb,
                           threads=args.threads)
        print(json.dumps(report))
    except DraftheadsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def merge(base: DraftFile, corpus: list[str], tokenizer, out: str | Path, min_count: int | None = None,
          coverage: float | None = None, validation: float | None = None, memory_mb: int = 1024,
          threads: int | None = None) -> dict:
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
                 memory_mb=memory_mb, threads=threads, base=base)


if __name__ == "__main__":
    main()