"""The windows of a token stream in sort partitions and spill groups (steps 2-4 of data/draft_file_build.py):
the partition plan, the spill, count passes over the groups by worker threads (data/draft_file_count.py counts a
partition), and the merge of the groups' runs in key order.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np

from data.draft_file import U64, context_keys, take_rows
from data.draft_file_count import ENTRY_FIELDS, WindowSpec, count_sorted, join_pieces, select_keys, sort_windows
from data.draft_file_tokenize import TokenStream
from models.errors import DraftheadsError

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
STREAM_CHUNK = 1 << 20  # tokens per step when scanning the token stream (~60 B a token of temporaries)


class Partitions:
    """The windows of one token stream: partition plan, spill to group files, count passes, run merge."""

    def __init__(self, tmp: Path, docs: TokenStream, spec: WindowSpec, memory_bytes: int, threads: int, log):
        self.tmp, self.spec, self.threads, self.memory = tmp, spec, threads, memory_bytes
        self.first = docs.first
        self.stream = np.memmap(docs.path.with_suffix(".stream"), dtype=spec.tdt.newbyteorder(">"), mode="r")
        # element s packs tokens s.. of the stream into one big-endian uint64 (strides of one token)
        self.view = np.ndarray((len(self.stream) - spec.per_word + 1,), ">u8", self.stream,
                               strides=(spec.tdt.itemsize,))
        if len(self.stream) >= 1 << 40:
            raise DraftheadsError(f"draft file build: {len(self.stream):,} tokens are more than one build takes "
                                  "(2^40); split the corpus and merge")
        if len(self.first) and int(self.first.max()) >= 1 << 32:  # bounds every count and total: all are uint32
            raise DraftheadsError(f"draft file build: a token starts {int(self.first.max()):,} windows, more than the "
                                  "file's 32-bit counts hold; split the corpus into builds under 4 billion tokens")
        self.windows = int(self.first.sum())
        per_window = _group_bytes_per_window(spec)
        capacity = max(1, memory_bytes // threads // per_window)  # windows one worker holds
        self.fine = min(FINE_WINDOWS, capacity)
        group = max(capacity, -(-self.windows // MAX_GROUPS))  # past MAX_GROUPS groups grow with the corpus...
        self.threads = max(1, min(threads, memory_bytes // (group * per_window)))  # ...and fewer count at once
        self._plan(group)
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

    def count(self, min_count: int, entries: bool, validation, sorted_io: str | None,
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


