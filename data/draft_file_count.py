"""Counting draft-file entries from sorted context windows (the core of data/draft_file_build.py).

A window is the W + L tokens starting at a position (W = longest order, L = max_len), PAD after its
document's end. Sorted lexicographically, the windows of one partition put every order-k context (the
first k tokens) in one run with its continuations (the next L tokens) in token order inside it, so one
sort serves all orders. lcp[r], the tokens windows r-1 and r share, gives every boundary: a new context
of order k where lcp < k, a new continuation prefix of j tokens where lcp < k + j. Keys are hashed after
counting, per kept context, instead of per record before sorting.

A prefix of j continuation tokens is kept when it occurs >= min_count times. Row r's depth (how many
levels of its continuation are kept) comes from one sliding-window pass: the prefix of j tokens occurs
>= c times exactly when some c consecutive rows around r all share k + j tokens. The trie's leaves
(kept prefixes no kept prefix extends), their ranking (most frequent first token, then second, then
token order) and their prefix counts follow from run boundaries, one pass per level that has rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.draft_file import SEED, U64, hash_finish, hash_step, take_rows

ENTRY_FIELDS = ("tokens", "counts", "second")  # per-entry arrays of a count; the rest are per key


@dataclass(frozen=True)
class WindowSpec:
    """What a window is and what is kept from it: orders, continuations per key (m), max_len (L), token dtype."""

    orders: tuple[int, ...]
    continuations: int
    max_len: int
    tdt: np.dtype

    @property
    def pad(self) -> int:
        return int(np.iinfo(self.tdt).max)

    @property
    def bits(self) -> int:
        return 8 * self.tdt.itemsize

    @property
    def per_word(self) -> int:  # tokens packed into one uint64 sort word, the first most significant
        return 64 // self.bits

    @property
    def width(self) -> int:  # tokens a window needs: the longest context and a full continuation
        return max(self.orders) + self.max_len

    @property
    def n_words(self) -> int:
        return -(-self.width // self.per_word)

    @property
    def gap(self) -> int:  # PAD tokens after each document: a window's last word never reads the next one
        return self.n_words * self.per_word - 1


def sort_windows(stream: np.ndarray, pos: np.ndarray, spec: WindowSpec) -> tuple[list[np.ndarray], np.ndarray]:
    """Sort the windows starting at `pos` of a big-endian token stream: (words [n_words] of [n], lcp [n] uint8).

    `stream` is a uint64 big-endian view of the stream advancing one token per element, so element s packs
    tokens s..s+per_word-1 with the first most significant: numeric order = token order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    words = [stream[pos + i * spec.per_word].astype(np.uint64) for i in range(spec.n_words)]
    if len(pos) > 1:  # Arrow's multi-column sort is ~3x numpy's lexsort here
        table = pa.table({str(i): w for i, w in enumerate(words)})
        order = pc.sort_indices(table, sort_keys=[(str(i), "ascending") for i in range(spec.n_words)]).to_numpy()
        del table
        words = [w[order] for w in words]
    return words, shared_prefix(words, spec)


def shared_prefix(words: list[np.ndarray], spec: WindowSpec) -> np.ndarray:
    """lcp[r] = leading tokens rows r-1 and r share (lcp[0] = 0), from the packed words of sorted windows."""
    n = len(words[0])
    lcp = np.zeros(n, np.uint8)
    if n < 2:
        return lcp
    same = np.ones(n - 1, bool)  # rows equal in every word so far
    for w in words:
        x = w[1:] ^ w[:-1]
        for j in range(1, spec.per_word + 1):  # x < 2^(64 - j*bits): the first j tokens of this word agree
            lcp[1:] += same & (x < U64(1) << U64(64 - j * spec.bits)) if j < spec.per_word else same & (x == 0)
        same &= x == 0
    return lcp


def token_at(words: list[np.ndarray], j: int, spec: WindowSpec, rows=None) -> np.ndarray:
    """Token j of each window (of `rows` only if given), int64."""
    w = words[j // spec.per_word] if rows is None else words[j // spec.per_word][rows]
    shift = 64 - spec.bits * (j % spec.per_word + 1)
    return ((w >> U64(shift)) & U64(spec.pad)).astype(np.int64)


def _sliding(x: np.ndarray, w: int, op) -> np.ndarray:
    """op (np.minimum / np.maximum) over every w consecutive elements: [len(x) - w + 1], by doubling spans."""
    out, span = x, 1
    while span * 2 <= w:
        out, span = op(out[:-span], out[span:]), span * 2
    n = len(x) - w + 1
    return op(out[:n], out[w - span: w - span + n]) if span < w else out[:n]


def shared_by_groups(lcp: np.ndarray, min_count: int) -> np.ndarray | None:
    """M[r] = the most tokens that some min_count consecutive rows containing r all share (None: min_count 1).

    A continuation prefix of row r (order k, j tokens) occurs >= min_count times iff M[r] >= k + j."""
    n = len(lcp)
    if min_count <= 1:
        return None
    if n < min_count:
        return np.zeros(n, np.uint8)
    shared = _sliding(lcp[1:], min_count - 1, np.minimum)  # [n - min_count + 1]: rows i..i+min_count-1 share
    edge = np.zeros(min_count - 1, np.uint8)
    return _sliding(np.concatenate([edge, shared, edge]), min_count, np.maximum)


def count_sorted(words, lcp, spec: WindowSpec, min_count: int, entries: bool = True) -> dict:
    """Every key of the sorted windows with its top-`continuations` leaves, all orders concatenated.

    Returns keys, orders, totals, n_entries (per key) and, per entry (the key's entries consecutive, best first),
    tokens [E, L'] (PAD after the kept prefix), counts [E, L'] (prefix counts, 0 after) and second [E] (the
    rank's tie-breaker: the count of the leaf's first two tokens, kept or not). entries=False keeps only the
    first token and count (L' = 1): enough for the coverage curve."""
    shared = shared_by_groups(lcp, min_count)
    parts = [_count_order(words, lcp, shared, k, spec, min_count, entries) for k in spec.orders]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _count_order(words, lcp, shared, k: int, spec: WindowSpec, min_count: int, entries: bool) -> dict:
    L, m = spec.max_len, spec.continuations
    valid = token_at(words, k, spec) != spec.pad  # rows with k context tokens and a next one
    groups = np.flatnonzero(lcp < k)  # first row of each context; its invalid rows (PAD at k) sort last in it
    # rows inside a kept first-level prefix (the rest make no entry), their lcp and kept continuation tokens
    live = np.flatnonzero(valid & (shared > k) if shared is not None else valid)
    lv = lcp[live].astype(np.int16)  # a live row after a row that is not: lcp < k + 1, a new node at every level
    depth = np.full(len(live), L, np.int16) if shared is None else np.minimum(shared[live].astype(np.int16) - k, L)
    # A leaf is a kept node no kept node extends: all its rows have the node's depth. Cut the rows where the
    # depth changes or a row starts its own deepest node; a piece that starts a node and is followed by a
    # row outside that node is a whole node of equal depths, i.e. a leaf. Its first row represents it.
    node_start = lv < k + depth
    piece = np.flatnonzero(node_start | np.r_[True, depth[1:] != depth[:-1]])
    closed = np.r_[lv[piece[1:]] < k + depth[piece[:-1]], True]
    pos = piece[node_start[piece] & closed]  # leaf rows (indices into live), in token order
    ldepth = depth[pos]
    key = np.cumsum(lcp < k, dtype=np.int32)[live[pos]] - 1  # index of the leaf's context in groups

    def prefix_count(j: int, at: np.ndarray) -> np.ndarray:  # occurrences of the first j tokens of rows `at`
        new_node = lv < k + j
        sizes = np.diff(np.r_[np.flatnonzero(new_node), len(lv)])
        return sizes[np.cumsum(new_node, dtype=np.int32)[at] - 1]

    pc1 = prefix_count(1, pos)
    second = prefix_count(2, pos) if L > 1 else np.zeros(len(pos), np.int64)  # kept or not: the rank's
    kept, first_leaf = rank_leaves(key, pc1, second, m)
    pos, ldepth, key, pc1, second = (a[kept] for a in (pos, ldepth, key, pc1, second))
    heads = key[first_leaf]
    head_rows = groups[heads]
    valid_before = np.r_[0, np.cumsum(valid, dtype=np.int64)]
    totals = valid_before[np.r_[groups, len(valid)][heads + 1]] - valid_before[head_rows]  # the context's records
    head_words = [w[head_rows] for w in words]
    h = np.full(len(heads), SEED, dtype=U64)
    for j in range(k):  # backward over the context, newest token first, as data.draft_file.context_keys
        h = hash_step(h, token_at(head_words, k - 1 - j, spec))
    width = L if entries else 1
    counts = np.zeros((len(pos), width), np.int64)
    counts[:, 0] = pc1
    if width > 1:
        counts[:, 1] = second
    for j in range(3, width + 1):
        at = np.flatnonzero(ldepth >= j)
        counts[at, j - 1] = prefix_count(j, pos[at])
    leaf_words = [w[live[pos]] for w in words]
    tokens = np.stack([token_at(leaf_words, k + j, spec) for j in range(width)], axis=1) if len(pos) else \
        np.zeros((0, width), np.int64)
    outside = np.arange(width) >= ldepth[:, None]  # past the leaf's kept prefix
    counts[outside], tokens[outside] = 0, spec.pad
    return {"keys": hash_finish(h, k), "orders": np.full(len(heads), k, np.uint8),
            "totals": totals.astype(np.uint32),
            "n_entries": np.diff(np.r_[np.flatnonzero(first_leaf), len(key)]).astype(np.uint32),
            "tokens": tokens.astype(spec.tdt), "counts": counts.astype(np.uint32), "second": second.astype(np.uint32)}


def rank_leaves(key: np.ndarray, pc1: np.ndarray, second: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-first order of leaves grouped by key (in token order within a key), cut at m per key: the kept
    leaves' indices and whether each is its key's first. Best = most frequent first token, then second; ties
    keep token order (stable)."""
    n = len(key)
    first = np.r_[True, key[1:] != key[:-1]] if n else np.empty(0, bool)
    starts = np.flatnonzero(first)
    n_leaves = np.diff(np.r_[starts, n])
    order = np.arange(n)
    multi = np.flatnonzero(np.repeat(n_leaves > 1, n_leaves))  # only keys with several leaves need sorting
    if len(multi):
        seg = np.cumsum(first)[multi].astype(np.int64)  # dense key ids, ascending
        worse1, worse2 = -pc1[multi].astype(np.int64), -second[multi].astype(np.int64)
        span = int(max(pc1[multi].max(), second[multi].max())) + 1
        if int(seg[-1]) * span * span < 2**62:  # one int64 sort key: (key, -pc1, -second)
            order[multi] = multi[np.argsort((seg * span + worse1 + span) * span + worse2 + span, kind="stable")]
        else:
            order[multi] = multi[np.lexsort((worse2, worse1, seg))]
    keep = np.arange(n) - starts[np.cumsum(first) - 1] < m if n else first
    return order[keep], first[keep]


def select_keys(out: dict, mask: np.ndarray) -> dict:
    """The keys of a count_sorted result where mask [K] holds, with their entries."""
    per_entry = np.flatnonzero(np.repeat(mask, out["n_entries"].astype(np.int64)))
    return {name: take_rows(a, per_entry) if name in ENTRY_FIELDS else a[mask] for name, a in out.items()}


def join_pieces(pieces: list[dict], totals: dict[int, int], m: int) -> dict:
    """One result for order-1 keys counted in pieces (their windows split by the first continuation token across
    partitions, so each leaf is whole in one piece): all pieces' leaves re-ranked, `totals` key -> occurrences."""
    cat = {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}
    per_entry = np.repeat(cat["keys"], cat["n_entries"].astype(np.int64))
    order = np.lexsort((cat["tokens"][:, 0], per_entry))  # token order within a key (pieces differ at token 0)
    kept, first = rank_leaves(per_entry[order], cat["counts"][order, 0], cat["second"][order], m)
    entries = order[kept]
    keys = per_entry[entries][first]
    return {"keys": keys, "orders": np.ones(len(keys), np.uint8),
            "totals": np.array([totals[int(k)] for k in keys], dtype=np.uint32),
            "n_entries": np.diff(np.r_[np.flatnonzero(first), len(entries)]).astype(np.uint32),
            **{name: take_rows(cat[name], entries) for name in ENTRY_FIELDS}}
