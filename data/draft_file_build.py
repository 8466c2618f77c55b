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
1. tokenize (data/draft_file_tokenize.py): documents are read in batches and encoded while the next batches are
   read: a tokenizer of GPT-2's byte-level BPE (SmolLM2, GPT-2) by data/cached_bpe.py in `--threads` worker
   processes, any other by the fast tokenizer's batch encoder (Rust threads), a long document in pieces (the
   same ids); each is appended to the stored corpus and to a token stream, PAD between documents, that windows are
   read from.
2. partition (data/draft_file_partition.py): the window starts are spilled to group files by first token,
   packed into sort partitions of at most FINE_WINDOWS. A first token with more windows is spread over several
   partitions by a hash of the second token (a token pair is never split); its order-1 key is counted in
   pieces and joined (data.draft_file_count.join_pieces).
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
import json
import os
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from data.draft_file import U64, VERSION, DraftFile, context_keys, token_dtype, write_file
from data.draft_file_count import WindowSpec
from data.draft_file_partition import Partitions
from data.draft_file_tokenize import TokenStream, is_validation, iter_token_batches
from models.errors import DraftheadsError, cli
from models.files import check_writable

POOL_CHARS = 32 << 20  # corpora larger than this are tokenized by `threads` worker processes
MAX_ORDER = 32  # the compiled lookup hashes at most 32 context tokens (data/_draft_lookup.c)
MAX_WINDOW = 255  # counting stores the tokens two sorted windows share (order + continuation) in a uint8
THRESHOLDS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)


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
def _remove_dead_builds(directory: Path) -> None:
    """Working directories (.dfl-build-PID@HOST.*) of this machine's builds killed (-9, out of memory) beside
    `directory`'s files: their corpus copy, token stream and runs hold ~10 bytes a token. A live build's (its process
    still runs) and another machine's (a shared volume) are left alone."""
    import shutil

    from models.files import _alive

    for d in directory.glob(".dfl-build-*@*"):
        pid, _, rest = d.name[len(".dfl-build-"):].partition("@")
        if d.is_dir() and pid.isdigit() and rest.rsplit(".", 1)[0] == socket.gethostname() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


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
    if len(set(orders)) != len(orders):
        raise DraftheadsError(f"draft file build: orders {list(orders)} repeat an order; give each once")
    if not orders or orders[0] < 1 or continuations < 1 or max_len < 1 or min_count < 1:
        raise DraftheadsError(f"draft file build needs orders >= 1, continuations >= 1, max-len >= 1, min-count >= 1; "
                              f"got orders={orders}, continuations={continuations}, max-len={max_len}, min-count={min_count}")
    if orders[-1] > MAX_ORDER or orders[-1] + max_len > MAX_WINDOW:  # lookups hash <= 32 tokens; lcp is a uint8
        raise DraftheadsError(f"draft file build takes orders <= {MAX_ORDER} and order + max-len <= {MAX_WINDOW}; got "
                              f"orders={orders}, max-len={max_len}")
    threads = threads or len(os.sched_getaffinity(0))
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))  # read when the tokenizer's pool starts
    progress = sys.stderr.isatty() if progress is None else progress
    bar = lambda **kw: tqdm(disable=not progress, dynamic_ncols=True, leave=False, **kw)  # noqa: E731
    tdt = token_dtype(vocab_size)
    spec = WindowSpec(orders, continuations, max_len, tdt)
    if spec.n_words * spec.per_word > MAX_WINDOW:  # sorted windows span whole words: their shared prefix too
        widest = MAX_WINDOW // spec.per_word * spec.per_word
        raise DraftheadsError(f"draft file build: with {spec.bits}-bit tokens order + max-len must be <= {widest}; got "
                              f"{orders[-1]} + {max_len}")
    memory = max(int(memory_mb * 2**20), 1 << 16)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(out.parent)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".dfl-build-{os.getpid()}@{socket.gethostname()}.") as tmp:
        tmp = Path(tmp)
        docs, val = TokenStream(tmp / "corpus.bin", tdt, spec, vocab_size), TokenStream(tmp / "val.bin", tdt)
        sources = list(base.header["sources"]) if base is not None else []
        if base is not None:  # stored corpus first, so merge(build(A), B) sees exactly build(A + B)'s token stream
            for sink, toks, offs in ((docs, base.corpus_tokens, base.doc_offsets),
                                     (val, base.val_tokens, base.val_offsets)):
                offs = offs.astype(np.int64)
                for a in range(0, len(offs) - 1, 4096):
                    sink.add([np.asarray(toks[x:y]) for x, y in zip(offs[a: a + 4096], offs[a + 1: a + 4097])])
        pretokenized = [[(np.asarray(d, dtype=np.int64), None) for d in token_docs]] if token_docs else []
        chars = _corpus_chars(corpus or [])
        workers = threads if chars > POOL_CHARS else 1  # spawning workers costs ~1 s
        with bar(total=chars, unit="char", unit_scale=True, desc="tokenize") as pbar:
            for batch in (*iter_token_batches(corpus or [], tokenizer, workers=workers), *pretokenized):
                ids = [i for i, _ in batch]
                top = max((int(i.max()) for i in ids if len(i)), default=-1)
                if top >= vocab_size:
                    raise DraftheadsError(f"tokenizer produced id {top} >= vocab size {vocab_size}; "
                                          "pass the target whose tokenizer this is (--target)")
                low = min((int(i.min()) for i in ids if len(i)), default=0)
                if low < 0:
                    raise DraftheadsError(f"a tokenized document holds id {low}: token ids are 0..{vocab_size - 1}")
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

        counter = Partitions(tmp, docs, spec, memory, threads, log)
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


@cli
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
    if args.cmd == "stats":
        print(json.dumps(stats(DraftFile(args.file))))
        return
    if args.cmd in ("build", "merge"):
        check_writable(args.out, "--out")
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