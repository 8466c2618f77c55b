"""DFlash draft files: a memory-mapped table from the last k tokens to a few counted continuations.

Key = 64-bit hash of (k, last k tokens); one sorted key array holds every order, back-off tries the
longest order first. Per key the file keeps the trie of its next-`max_len`-token continuations cut
where a prefix occurs fewer than `min_count` times, as up to `continuations` leaves (the most frequent
path first) with exact prefix counts, so each token has P(t_j | key, t_<j) as its confidence.

This module is the format: hashing, the reader (`DraftFile`: checks, lookup of one context or a batch,
hot/cold placement) and the one writer (`write_file`). A lookup finds keys through an index of their top
bits built on first use (one bucket of ~2 keys read instead of a binary search's ~25 cache misses). Lookups
run in data/_draft_lookup.c when setup.py could compile it (3-10x faster); the numpy code here is its
reference, used without a compiler, for hot tables and by the tests.
Building, merging, coverage sizing and the CLI live in data/draft_file_build.py (counting in
data/draft_file_count.py):

    python -m data.draft_file build|stats|inspect|merge ...   (see data/draft_file_build.py)

Layout (little endian): 8-byte magic, u32 version, u32 header length, u32 header crc32, u32 body
crc32, JSON header, then 64-byte-aligned sections: keys u64 [K] (sorted), key_orders u8 [K],
key_totals u32 [K] (all occurrences), key_offsets u64 [K+1], entry_tokens tok [E, L] (PAD-filled),
entry_counts u32 [E, L] (prefix counts), corpus_tokens tok [N], doc_offsets u64 [D+1], val_tokens
tok [V], val_offsets u64 [DV+1].
"""

from __future__ import annotations

import bisect
import json
import math
import mmap
import struct
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from models.errors import DraftheadsError
from models.files import write_whole

try:  # the compiled lookups (setup.py builds them when a C compiler is there); the numpy code below is their reference
    from data._draft_lookup import Table as _CompiledTable
except ImportError:
    _CompiledTable = None

MAGIC = b"DFLASHDF"
VERSION = 1
PREFIX = struct.Struct("<8sIIII")  # magic, version, header length, header crc32, body crc32
ALIGN = 64
M64 = (1 << 64) - 1
C1, C2, C3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
SEED = 0x2545F4914F6CDD1D
U64 = np.uint64
INDEX_CHUNK = 1 << 22  # keys per step of building the index: its peak beyond the index itself stays ~100 MB
KEYS_PER_BUCKET = 2  # average keys per bucket of the lookup index (its size: 4 / KEYS_PER_BUCKET bytes a key)
SECTIONS = ("keys", "key_orders", "key_totals", "key_offsets", "entry_tokens", "entry_counts",
            "corpus_tokens", "doc_offsets", "val_tokens", "val_offsets")


# ---------------------------------------------------------------------------------------------
# hashing: backward over the context (newest token first) so every order shares one pass
# ---------------------------------------------------------------------------------------------
def hash_step(h, t):
    """Absorb token t (numpy uint64 arrays or Python ints): h = (h ^ (t+1)) * C1, then fold high bits."""
    if isinstance(h, int):
        h = ((h ^ (t + 1)) * C1) & M64
        return h ^ (h >> 31)
    h = h ^ np.add(t, U64(1), dtype=U64, casting="unsafe")  # in-place below: small batches pay per numpy call
    h *= U64(C1)
    h ^= h >> U64(31)
    return h


def hash_finish(h, k):
    """splitmix64 finaliser of h tagged with the order k (an int, or an array broadcasting with h), so orders
    never share keys."""
    if isinstance(h, int):
        z = h ^ (k << 56)
        z = ((z ^ (z >> 30)) * C2) & M64
        z = ((z ^ (z >> 27)) * C3) & M64
        return z ^ (z >> 31)
    z = h ^ (np.asarray(k, dtype=U64) << U64(56))
    z ^= z >> U64(30)
    z *= U64(C2)
    z ^= z >> U64(27)
    z *= U64(C3)
    z ^= z >> U64(31)
    return z


def context_keys(context: np.ndarray, orders: tuple[int, ...]) -> np.ndarray:
    """Keys [B, len(orders)] of contexts [B, W] (newest token last; -1 = missing, left side); 0 where too short."""
    context = np.asarray(context, dtype=np.int64)
    n = max(orders)
    if context.shape[1] < n:
        context = np.concatenate([np.full((len(context), n - context.shape[1]), -1), context], axis=1)
    newest_first = context[:, :-n - 1:-1]  # [B, n]
    steps = np.empty((n, len(context)), U64)  # steps[j] = hash after absorbing the newest j+1 tokens
    h = np.full(len(context), SEED, dtype=U64)
    for j in range(n):
        h = steps[j] = hash_step(h, newest_first[:, j])
    at = np.array(orders) - 1
    keys = hash_finish(steps[at], at[:, None] + 1)  # [n_orders, B]
    keys *= np.logical_and.accumulate(newest_first >= 0, axis=1)[:, at].T  # 0 where a token is missing
    return keys.T


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size < 0xFFFF else np.dtype("<u4")


# ---------------------------------------------------------------------------------------------
# the file
# ---------------------------------------------------------------------------------------------
@dataclass
class Candidates:
    """Everything the file knows about one context: the longest matching order's continuations. From
    lookup_batch, about each of B contexts: every field has a leading [B] axis (order 0, no entries: no match)."""

    order: int | np.ndarray
    tokens: np.ndarray  # [(B,) m, L] int64, -1 after a continuation's end; the most frequent path first
    prefix_counts: np.ndarray  # [(B,) m, L] int64: occurrences of key + tokens[:j+1] (0 after the end)
    total: int | np.ndarray  # occurrences of the key in the corpus

    @property
    def lengths(self) -> np.ndarray:  # [(B,) m]
        return (self.tokens >= 0).sum(-1)

    @property
    def counts(self) -> np.ndarray:  # [(B,) m] occurrences of each whole continuation
        last = np.maximum(self.lengths - 1, 0)[..., None]
        return np.take_along_axis(self.prefix_counts, last, axis=-1)[..., 0]

    @property
    def confidences(self) -> np.ndarray:  # [(B,) m, L] P(token j | key, tokens < j); 0 after the end
        total = np.broadcast_to(np.asarray(self.total)[..., None, None], self.prefix_counts.shape[:-1] + (1,))
        before = np.concatenate([total, self.prefix_counts[..., :-1]], axis=-1)
        return self.prefix_counts / np.maximum(before, 1)


class DraftFile:
    """A draft file opened read-only and memory-mapped; refuses foreign, truncated or corrupted files."""

    def __init__(self, path: str | Path, verify: bool = True):
        self.path = Path(path)
        if not self.path.is_file():
            raise DraftheadsError(f"draft file '{self.path}' does not exist; build one with `python -m data.draft_file build`")
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.path.stat().st_size else b""
        buf = self._mmap
        if len(buf) < PREFIX.size or buf[:8] != MAGIC:
            raise DraftheadsError(f"'{self.path}' is not a draft file (bad magic); pass a .dfl built by data.draft_file")
        _, version, hlen, hcrc, bcrc = PREFIX.unpack_from(buf, 0)
        if version != VERSION:
            raise DraftheadsError(f"draft file '{self.path}' has format version {version}, this code reads {VERSION}; rebuild it")
        raw = bytes(buf[PREFIX.size: PREFIX.size + hlen])
        if len(raw) != hlen or zlib.crc32(raw) != hcrc:
            raise DraftheadsError(f"draft file '{self.path}' has a corrupted or truncated header (checksum mismatch); rebuild it")
        self.header = json.loads(raw)
        if len(buf) != self.header["file_bytes"]:
            raise DraftheadsError(f"draft file '{self.path}' is {len(buf)} bytes but its header says "
                                  f"{self.header['file_bytes']}: truncated or appended to; rebuild or re-copy it")
        if verify and _crc_range(buf, self.header["body_start"], len(buf)) != bcrc:
            raise DraftheadsError(f"draft file '{self.path}' is corrupted (body checksum mismatch); rebuild or re-copy it")
        for name, (offset, dtype, shape) in self.header["sections"].items():
            count = int(np.prod(shape))
            setattr(self, name, np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(shape))
        self.orders = tuple(self.header["orders"])
        if list(self.orders) != sorted(set(self.orders)):
            raise DraftheadsError(f"draft file '{self.path}' lists orders {list(self.orders)}, not ascending once "
                                  "each (a build before 2026-12-06 took repeated --orders); rebuild it")
        self.max_len = self.header["max_len"]
        self.pad = int(np.iinfo(np.dtype(self.header["token_dtype"])).max)
        self._orders_desc_k = sorted(self.orders, reverse=True)
        self._orders_array = np.array(self.orders)
        self._per_key = (_as_ints(self.key_offsets), _as_ints(self.key_orders), _as_ints(self.key_totals))
        self._pad_table = None  # 16-bit tokens: int64 value of every token, PAD -> -1
        if self.entry_tokens.dtype.itemsize == 2:
            self._pad_table = np.arange(1 << 16, dtype=np.int64)
            self._pad_table[self.pad] = -1
        self._find_one = None  # (bucket starts, keys) as int sequences: built by _index on the first lookup
        self._compiled = None  # data/_draft_lookup.c's Table over the same sections, also built by _index
        self._hot = None

    # -- identity -----------------------------------------------------------------------------
    def check_target(self, target) -> None:
        """Refuse a file built for another tokenizer (hash and vocab size in the header)."""
        target.check_fingerprint(self.header["target"], f"draft file '{self.path}'", keys=("vocab_size", "tokenizer_hash"))

    def check_tokenizer(self, tokenizer) -> None:
        from models.target import tokenizer_hash

        mine, theirs = tokenizer_hash(tokenizer), self.header["target"]["tokenizer_hash"]
        if mine != theirs:
            raise DraftheadsError(f"draft file '{self.path}' was built for tokenizer {theirs} "
                                  f"(target '{self.header['target']['name']}') but this tokenizer hashes to {mine}; "
                                  "rebuild the file with this target's tokenizer (--target)")

    @property
    def n_keys(self) -> int:
        return int(self.keys.shape[0])

    @property
    def n_entries(self) -> int:
        return int(self.entry_counts.shape[0])

    # -- lookup -------------------------------------------------------------------------------
    # A binary search over the whole key array costs one cache (and TLB) miss per step. The bucket index
    # (built on the first lookup) maps a key's top bits to the few keys that share them, so a lookup reads one
    # bucket: keys are uniform hashes, KEYS_PER_BUCKET on average.
    def _index(self) -> None:
        bits = max(1, math.ceil(math.log2(max(1, self.n_keys) / KEYS_PER_BUCKET)))
        self._shift = 64 - bits
        dtype = np.uint32 if self.n_keys < 2**32 else np.int64
        self._bucket = np.zeros((1 << bits) + 1, dtype)  # keys of bucket b: [bucket[b], bucket[b+1])
        per = self._bucket[1:]  # keys per bucket, counted in place, then summed in place
        for a in range(0, self.n_keys, INDEX_CHUNK):  # sorted keys: each chunk's buckets are one ascending range
            top = (self.keys[a: a + INDEX_CHUNK] >> U64(self._shift)).astype(np.intp)
            per[top[0]: top[-1] + 1] += np.bincount(top - top[0]).astype(dtype)
        widest = int(per.max()) if self.n_keys else 1
        np.cumsum(per, out=per)
        self._window = np.arange(max(1, widest))  # offsets into a bucket, up to the widest
        self._find_one = (_as_ints(self._bucket), _as_ints(self.keys))
        if self.use_compiled and _CompiledTable is None:
            warnings.warn("draft-file lookups run on the numpy reference (3-10x slower): data/_draft_lookup.c was not "
                          "compiled; install a C compiler and the Python headers, then `pip install -e .`", stacklevel=3)
        elif self.use_compiled:
            self._compiled = _CompiledTable(self.keys, self._bucket, self._shift, self.key_orders, self.key_totals,
                                            self.key_offsets, self.entry_tokens, self.entry_counts, self.orders,
                                            self.pad)

    def _find(self, key: int) -> int:
        """Index of one key in the key array, or -1."""
        bucket, keys = self._find_one
        b = key >> self._shift
        lo, hi = bucket[b], bucket[b + 1]
        i = bisect.bisect_left(keys, key, lo, hi)
        return i if i < hi and keys[i] == key else -1

    use_compiled = True  # False: the numpy reference answers (tests compare the two)

    def lookup(self, context) -> Candidates | None:
        """All candidates for one context (newest token last), longest matching order first; None if none."""
        if self._find_one is None:
            self._index()
        if self._compiled is not None:
            shape = (self.header["continuations"], self.max_len)
            tokens, counts = np.empty(shape, np.int64), np.empty(shape, np.int64)
            found = self._compiled.lookup(context, tokens, counts)
            if found is None:
                return None
            order, n, total = found
            return Candidates(order, tokens[:n], counts[:n], total)
        tail = context[-self.orders[-1]:]
        ctx = tail.tolist() if hasattr(tail, "tolist") else [int(t) for t in tail]
        n, steps, h = len(ctx), [], SEED
        for j in range(min(n, self.orders[-1])):  # Python ints: numpy's per-call cost dominates for 4 tokens
            h = ((h ^ (ctx[n - 1 - j] + 1)) * C1) & M64
            h ^= h >> 31
            steps.append(h)
        for k in self._orders_desc_k:
            if k <= len(steps):
                idx = self._find(hash_finish(steps[k - 1], k))
                if idx >= 0:
                    return self._candidates(idx)
        return None

    def _candidates(self, idx: int) -> Candidates:
        offsets, orders, totals = self._per_key
        a, b = offsets[idx], offsets[idx + 1]
        return Candidates(orders[idx], self._signed_tokens(self.entry_tokens[a:b]),
                          self.entry_counts[a:b].astype(np.int64), totals[idx])

    def _signed_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """int64 copy with PAD as -1 (one table lookup for 16-bit tokens)."""
        if self._pad_table is not None:
            return self._pad_table[tokens.astype(np.intp)]  # an intp index is the fast path
        out = tokens.astype(np.int64)
        out[out == self.pad] = -1
        return out

    def find_keys(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For contexts [B, W] (newest last, -1 = missing): index [B] of the longest matching key (-1 = miss), its
        order [B] (0 = miss) and whether it was found in the hot table [B] (then the index is into the hot table)."""
        if self._find_one is None:
            self._index()
        keys = context_keys(context, self.orders)  # [B, n_orders], 0 = context too short
        B = len(keys)
        flat = keys.ravel()
        lo = self._bucket[(flat >> U64(self._shift)).astype(np.intp)]
        # the widest bucket from each query's first key: a key equal to the query can only sit in its own bucket
        window = lo[:, None] + self._window  # [B * n_orders, widest bucket]
        np.minimum(window, self.n_keys - 1, out=window)
        hit = self.keys[window] == flat[:, None] if self.n_keys else np.zeros(window.shape, bool)
        found = hit.any(1).reshape(B, len(self.orders)) & (keys != 0)  # [B, n_orders]
        from_longest = found[:, ::-1].argmax(1)  # 0 where nothing matched: checked below
        longest = len(self.orders) - 1 - from_longest
        rows = np.arange(B)
        idx = lo.reshape(B, len(self.orders))[rows, longest] + hit.argmax(1).reshape(B, len(self.orders))[rows, longest]
        miss = ~found[rows, longest]
        idx[miss] = -1
        order = self._orders_array[longest]
        order[miss] = 0
        hot = np.zeros(B, bool)
        if self._hot is not None and not miss.all():
            rows = np.flatnonzero(~miss)  # the hot table holds a subset of the keys: answer from it where it can
            hot_at, hot_hit = self._hot_search(keys[rows, longest[rows]])
            idx[rows[hot_hit]], hot[rows[hot_hit]] = hot_at[hot_hit], True
        return idx, order, hot

    def lookup_batch(self, context: np.ndarray) -> Candidates:
        """Candidates for contexts [B, W] (newest last, -1 = missing) in one call: tokens [B, m, L] (-1 pad),
        prefix counts [B, m, L] (0 = none), order [B] (0 = no key), total [B].

        With a hot table (place_hot) its keys are answered from device tensors, the rest from the memmap."""
        m = self.header["continuations"]
        if self._find_one is None:
            self._index()
        if self._compiled is not None and self._hot is None:
            context = np.ascontiguousarray(context, dtype=np.int64)
            B = len(context)
            tokens, counts = np.empty((B, m, self.max_len), np.int64), np.empty((B, m, self.max_len), np.int64)
            order, totals = np.empty(B, np.int64), np.empty(B, np.int64)
            self._compiled.lookup_batch(context, tokens, counts, order, totals)
            return Candidates(order, tokens, counts, totals)
        idx, order, hot = self.find_keys(context)
        tokens = np.full((len(idx), m, self.max_len), -1, np.int64)
        counts = np.zeros((len(idx), m, self.max_len), np.int64)
        totals = np.zeros(len(idx), np.int64)
        for table, rows in ((self._hot, np.flatnonzero(hot)), (self._cold, np.flatnonzero(~hot & (idx >= 0)))):
            if table is None or not len(rows):
                continue
            offsets, ent_tokens, ent_counts = table["offsets"], table["tokens"], table["counts"]
            k = idx[rows]
            start = _np(offsets[k])
            e = start[:, None] + np.arange(m)
            missing = e >= _np(offsets[k + 1])[:, None]  # [R, m] past the key's entries
            np.minimum(e, len(ent_tokens) - 1, out=e)
            if table is self._hot:
                got_tokens, got_counts = _np(ent_tokens[e]), _np(ent_counts[e])
            else:
                got_tokens = self._signed_tokens(take_rows(ent_tokens, e))
                got_counts = take_rows(ent_counts, e).astype(np.int64)
            got_tokens[missing], got_counts[missing] = -1, 0
            tokens[rows], counts[rows], totals[rows] = got_tokens, got_counts, _np(table["totals"][k])
        if self._hot is not None:
            tokens[tokens == self.pad] = -1  # the hot table keeps the file's PAD
        return Candidates(order, tokens, counts, totals)

    @property
    def _cold(self) -> dict:
        return {"offsets": self.key_offsets, "tokens": self.entry_tokens, "counts": self.entry_counts,
                "totals": self.key_totals}

    # -- hot / cold placement -----------------------------------------------------------------
    def place_hot(self, fraction: float, device="cpu") -> dict:
        """Copy the keys holding the most frequent `fraction` of entries (ranked by occurrences) to torch tensors
        on `device`; lookup_batch answers them from there and reads only the rest from the memmap."""
        import torch

        by_total = np.argsort(-self.key_totals.astype(np.int64), kind="stable")
        sizes = np.diff(self.key_offsets.astype(np.int64))
        n_hot = int(np.searchsorted(np.cumsum(sizes[by_total]), fraction * self.n_entries, side="right"))
        signed = self.keys.view(np.int64)[by_total[:n_hot]]  # torch has no uint64: search the int64 view, sorted as such
        sel = by_total[:n_hot][np.argsort(signed, kind="stable")]
        start = self.key_offsets[sel].astype(np.int64)
        hot_offsets = np.r_[0, np.cumsum(sizes[sel])]
        ent = np.repeat(start - hot_offsets[:-1], sizes[sel]) + np.arange(hot_offsets[-1])  # entry ids, hot order
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
        self._hot = {"keys": t(self.keys.view(np.int64)[sel]), "offsets": t(hot_offsets),
                     "totals": t(self.key_totals[sel].astype(np.int64)),
                     "tokens": t(self.entry_tokens[ent].astype(np.int64)), "counts": t(self.entry_counts[ent].astype(np.int64))}
        return {"hot_fraction": fraction, "hot_keys": n_hot, "hot_entries": int(hot_offsets[-1]),
                "hot_bytes": int(sum(v.numel() * v.element_size() for v in self._hot.values()))}

    def _hot_search(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch

        hk = self._hot["keys"]
        if not len(hk):
            return np.zeros(len(keys), np.int64), np.zeros(len(keys), bool)
        q = torch.from_numpy(keys.view(np.int64).copy()).to(hk.device)
        at = torch.searchsorted(hk, q).clamp(max=len(hk) - 1)
        return at.cpu().numpy(), (hk[at] == q).cpu().numpy()

    def hot_hit_rate(self, context: np.ndarray) -> dict:
        """Of the contexts the file answers, the share the hot table answers (the hit-rate cost of keeping X% hot)."""
        idx, _, hot = self.find_keys(context)
        hits = idx >= 0
        return {"hit_rate": float(hits.mean()), "hot_share_of_hits": float(hot[hits].mean()) if hits.any() else 0.0}


def take_rows(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """a[idx] for a 2-d array [N, L] (1-d: plain a[idx]), idx of any shape. A row moves as one void item:
    numpy's 2-d fancy index copies element by element, several times slower."""
    if a.ndim == 1:
        return a[idx]
    a = np.ascontiguousarray(a)
    rows = a.view(f"V{a.shape[1] * a.itemsize}").reshape(len(a))
    return rows[idx].view(a.dtype).reshape(*np.shape(idx), a.shape[1])


def _as_ints(a: np.ndarray):
    """A 1-d little-endian integer array as a sequence of Python ints (memoryview: no numpy scalar per item)."""
    a = np.ascontiguousarray(a)
    return memoryview(a).cast("B").cast({1: "B", 2: "H", 4: "I", 8: "Q"}[a.dtype.itemsize]) if len(a) else []


def _np(x) -> np.ndarray:
    return x.cpu().numpy().astype(np.int64) if hasattr(x, "cpu") else np.asarray(x, dtype=np.int64)


def _crc_range(buf, start: int, end: int, chunk: int = 1 << 24) -> int:
    crc, view = 0, memoryview(buf)
    for a in range(start, end, chunk):
        crc = zlib.crc32(view[a: min(end, a + chunk)], crc)
    view.release()
    return crc


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def write_file(out: Path, header: dict, chunks: Iterable[dict], n_keys: int, n_entries: int, stored, tdt,
               max_len: int) -> None:
    """Write the table and the stored corpus: header, aligned sections, checksums last.

    `chunks` come in key order, each a dict of keys, orders, totals, n_entries (per key) and tokens, counts (per
    entry), n_keys / n_entries in all; `stored` = (tokens, doc_offsets, val_tokens, val_offsets) or None."""
    K, E = n_keys, n_entries
    tokens, doc_offsets, vtokens, val_offsets = stored or (np.empty(0, tdt), np.zeros(1, np.uint64)) * 2
    N, D, NV, DV = len(tokens), len(doc_offsets) - 1, len(vtokens), len(val_offsets) - 1
    shapes = {"keys": ("<u8", [K]), "key_orders": ("|u1", [K]), "key_totals": ("<u4", [K]),
              "key_offsets": ("<u8", [K + 1]), "entry_tokens": (tdt.str, [E, max_len]),
              "entry_counts": ("<u4", [E, max_len]),
              "corpus_tokens": (tdt.str, [N]), "doc_offsets": ("<u8", [D + 1]),
              "val_tokens": (tdt.str, [NV]), "val_offsets": ("<u8", [DV + 1])}
    # layout needs the header length; it depends on offsets only through their digits, so iterate to a fixpoint
    header["sections"], hlen = {}, 0
    for _ in range(4):
        pos = _align(PREFIX.size + hlen)
        body_start, sections = pos, {}
        for name in SECTIONS:
            dt, shape = shapes[name]
            sections[name] = [pos, dt, shape]
            pos = _align(pos + int(np.prod(shape)) * np.dtype(dt).itemsize)
        header.update(sections=sections, body_start=body_start, file_bytes=pos, n_keys=K, n_entries=E,
                      corpus_tokens=N, documents=D, validation_documents=DV,
                      table_bytes=sections["corpus_tokens"][0] - body_start)
        raw = json.dumps(header, sort_keys=True).encode()
        if len(raw) == hlen:
            break
        hlen = len(raw)

    def write(path: Path) -> None:  # under a temporary name, renamed into place: a reader of the old file keeps it
        with open(path, "wb") as f:
            f.truncate(header["file_bytes"])
            at = {name: sec[0] for name, sec in sections.items()}  # where each section's next bytes go

            def put(name, arr):
                a = np.ascontiguousarray(arr, dtype=np.dtype(sections[name][1]))
                f.seek(at[name])
                a.tofile(f)
                at[name] += a.nbytes

            put("key_offsets", np.zeros(1))
            written = 0  # entries so far
            for c in chunks:
                for name, field in (("keys", "keys"), ("key_orders", "orders"), ("key_totals", "totals"),
                                    ("entry_tokens", "tokens"), ("entry_counts", "counts")):
                    put(name, c[field])
                put("key_offsets", written + np.cumsum(c["n_entries"], dtype=np.int64))
                written += int(np.sum(c["n_entries"], dtype=np.int64))
            if at["keys"] != sections["keys"][0] + 8 * K or written != E:
                raise RuntimeError(f"draft file writer got {(at['keys'] - sections['keys'][0]) // 8} keys and {written} "
                                   f"entries, expected {K} and {E}")
            for a in range(0, N, 1 << 24):
                put("corpus_tokens", tokens[a: a + (1 << 24)])
            put("doc_offsets", doc_offsets)
            put("val_tokens", vtokens)
            put("val_offsets", val_offsets)
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
            body_crc = _crc_range(mm, header["body_start"], header["file_bytes"])
            mm.close()
            f.seek(0)
            f.write(PREFIX.pack(MAGIC, VERSION, len(raw), zlib.crc32(raw), body_crc) + raw)

    write_whole(Path(out), write)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


if __name__ == "__main__":  # the CLI lives with the builder
    import sys

    from data.draft_file_build import main

    sys.exit(main())
