"""Tokenizing corpora for draft files (step 1 of data/draft_file_build.py): byte-level BPE tokenizers through the
cached encoder (data/cached_bpe.py) in worker processes, others through the fast tokenizer's batch encoder (long
documents in pieces that keep their ids), pipelined with reading; and the token stream windows are read from.
"""

from __future__ import annotations

import itertools
import re
import zlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from data.cached_bpe import CachedByteLevelBPE
from data.draft_file_count import WindowSpec

BATCH_CHARS = 1 << 20  # characters per tokenizer batch (two in flight: their encodings are ~100 B a token)
PIECE_CHARS = 1 << 16  # a longer document is encoded in pieces: bounded tokenizer memory, balanced threads
PIECE_CUT = re.compile(r"(?<=.)(?=\n\S)", re.S)  # before a newline that ends a whitespace run and starts a line
PROBE = ("import os\n\n\nclass A(B):\n    def f(self, x=1):  # note\n        return {'a': [x, 2.5e-3]}\n\n"
         "Hello, world! It's 12345 o'clock.\nWie geht's? Ça va. 中文文本。\n\tTabbed\nend;\r\nnext  \n\nx\n"
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n- item\n#include <x>\n}\n@decorator\n")


def document_pieces(text: str) -> list[str]:
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


def batch_encoder(tokenizer):
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
        split = [document_pieces(t) for t in texts]
        ids = iter(whole([p for ps in split for p in ps]))
        return [next(ids) if len(ps) == 1 else list(itertools.chain.from_iterable(next(ids) for _ in ps))
                for ps in split]

    return in_pieces


_worker_encoder: CachedByteLevelBPE | None = None


def _start_worker(encoder: CachedByteLevelBPE) -> None:
    global _worker_encoder
    _worker_encoder = encoder  # unpickled from the tokenizer's JSON: each worker keeps its own caches


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _worker_encoder.encode_flat(texts)


def iter_token_batches(paths: Iterable[str], tokenizer, batch_chars: int | None = None,
                       workers: int = 1) -> Iterator[list]:
    """[(token ids, text)] per batch of documents of every corpus path, in order; batches are read while the ones
    before are encoded (by `workers` processes where the cached encoder serves the tokenizer)."""
    from data.readers import iter_documents

    batch_chars = batch_chars or BATCH_CHARS
    cached = CachedByteLevelBPE.of(tokenizer)
    if cached is None:
        encode = batch_encoder(tokenizer)
        flat_ids = lambda texts: _flatten(encode(texts))  # noqa: E731
        pool = ThreadPoolExecutor(1)
    elif workers > 1:
        flat_ids = _encode_in_worker
        pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _start_worker, (cached,))
    else:
        flat_ids, pool = cached.encode_flat, ThreadPoolExecutor(1)  # holds the GIL: pipelining gains nothing

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
        (flat, lens), texts = job[0].result(), job[1]
        return list(zip(np.split(flat, np.cumsum(lens)[:-1]), texts))

    with pool:
        pending = []
        for texts in batches():
            pending.append((pool.submit(flat_ids, texts), texts))
            if len(pending) > max(workers, 1):
                yield done(pending.pop(0))
        while pending:
            yield done(pending.pop(0))


def _flatten(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.array([len(i) for i in ids], np.int64)
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lens.sum())), lens


def is_validation(text: str | bytes, fraction: float) -> bool:
    """Held-out split by content hash: independent of corpus order, batching and merging."""
    data = text.encode() if isinstance(text, str) else text
    return fraction > 0 and zlib.crc32(data) % 10_000 < fraction * 10_000


class TokenStream:
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

