"""The fast tokenizer's ids for GPT-2-style byte-level BPE, with caches: what draft-file builds encode corpora with.

A byte-level BPE tokenizer (no normalizer, the ByteLevel pre-tokenizer with GPT-2's regex) encodes every word of
that regex on its own, so a word's ids can be cached, and so can a longer *piece*: cut a text before a whitespace
character that follows a non-whitespace one and no word of the regex crosses the cut (a word that is not
whitespace never holds whitespace, and the only look-ahead, `\\s+(?!\\S)`, sits inside whitespace runs). Pieces
(`\\s*\\S+`: "\\n    return", " x.y(z)") repeat far more than documents do: a piece found in the cache costs one
dict lookup; a new piece is cut into words (each cached too) and only a new word reaches the BPE model itself.
Added tokens (`<|im_start|>`) are split out first, as the tokenizer does; they hold no whitespace, or the
encoder is not used.

`CachedByteLevelBPE.of(tokenizer)` returns None for any other tokenizer, or when its ids differ from the
tokenizer's on PROBE; tests hold both equal on every Unicode code point in several contexts. Letters and numbers are
classed by Python's Unicode database; a piece with a code point it leaves unassigned is encoded by the tokenizer.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import sys
import unicodedata

import numpy as np

ASCII_WORDS = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\t-\r A-Za-z0-9]+|[\t-\r ]+(?![^\t-\r ])|[\t-\r ]+"""
MAX_PIECES, MAX_WORDS = 1 << 20, 1 << 19  # cache entries; a full cache starts again (~150 B an entry)
MAX_PIECE_CHARS = 256  # longer pieces (minified code, blobs) rarely repeat: cut into words, not cached
PROBE = ("import os\n\n\nclass A(B):\n    def f(self, x=1):  # note\n        return {'a': [x, 2.5e-3]}\n\n"
         "Hello, world! It's 12345 o'clock. We'll see; they've I'm you'd\nWie geht's? Ça va. 中文文本。 ١٢٣ Ⅻ\n"
         "\tTabbed\nend;\r\nnext  \n\nx\u00a0\u00a0 y\u3000z \u2028\u0085\x1c.\x1f\u200b \u180e!\n"
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n- item\n#include <x>\n}\n@decorator\n  \n")


@functools.cache
def gpt2_regexes() -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    """(pieces, GPT-2's words, unassigned code points). The classes are spelled out from Python's Unicode
    database: whitespace is Unicode's White_Space (Python's `\\s` adds U+001C-U+001F, which the tokenizer's regex
    does not), letters L*, numbers N*. A regex library of another Unicode version classes the code points that
    database leaves unassigned otherwise, so pieces holding one go to the tokenizer itself."""
    classes: dict[str, list[int]] = {"space": [], "L": [], "N": [], "unassigned": []}
    for c in range(sys.maxunicode + 1):
        cat = unicodedata.category(chr(c))
        key = ("unassigned" if cat in ("Cn", "Cs") else "space" if chr(c).isspace() and not 0x1C <= c <= 0x1F
               else cat[0])
        if key in classes:
            classes[key].append(c)

    def ranges(cps: list[int]) -> str:
        runs = (list(g) for _, g in itertools.groupby(cps, key=lambda c, n=itertools.count(): c - next(n)))
        return "".join(re.escape(chr(r[0])) + (f"-{re.escape(chr(r[-1]))}" if len(r) > 1 else "") for r in runs)

    S, L, N = ranges(classes["space"]), ranges(classes["L"]), ranges(classes["N"])
    words = rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+|[{S}]+(?![^{S}])|[{S}]+"""
    return re.compile(f"[{S}]*[^{S}]+|[{S}]+"), re.compile(words), re.compile(f"[{ranges(classes['unassigned'])}]")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer writes words in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


class CachedByteLevelBPE:
    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        self.json = tokenizer_json
        self.backend = backend = Tokenizer.from_str(tokenizer_json)
        backend.no_truncation()
        backend.no_padding()
        self.model = backend.model
        self.added = added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
        self.split_added = (re.compile("(" + "|".join(map(re.escape, sorted(added, key=len, reverse=True))) + ")")
                            if added else None)
        self.cut, self.words, self.unassigned = gpt2_regexes()
        self.ascii_words = re.compile(ASCII_WORDS)  # the same words on ASCII text, without the large classes
        self.bytes = byte_alphabet()  # a str.translate table over the latin-1 code points of a word's bytes
        self.pieces: dict[str, tuple] = {}
        self.word_ids: dict[str, tuple] = {}

    @classmethod
    def of(cls, tokenizer) -> "CachedByteLevelBPE | None":
        """The encoder for a transformers fast tokenizer (or a `tokenizers.Tokenizer`), or None where it would not
        give the tokenizer's own ids."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "to_str"):
            return None
        text = backend.to_str()
        spec = json.loads(text)
        pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
        if (spec.get("normalizer") is not None or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True)
                or pre.get("add_prefix_space") or model.get("type") != "BPE" or model.get("dropout")):
            return None
        for t in spec.get("added_tokens", []):
            if t.get("single_word") or t.get("lstrip") or t.get("rstrip") or re.search(r"\s", t["content"]):
                return None
        enc = cls(text)
        ref = backend.encode(PROBE, add_special_tokens=False).ids
        return enc if enc.encode([PROBE])[0].tolist() == ref else None

    def __reduce__(self):  # worker processes rebuild it from the tokenizer's JSON (empty caches)
        return CachedByteLevelBPE, (self.json,)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids (int64) of each text, as the tokenizer's encode(text, add_special_tokens=False) gives them."""
        flat, lens = self.encode_flat(texts)
        return np.split(flat, np.cumsum(lens)[:-1]) if len(texts) else []

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(all ids concatenated [N], ids per text [len(texts)])."""
        per_text, lens = [], np.zeros(len(texts), np.int64)
        for k, text in enumerate(texts):
            pieces = self.cut.findall(text)
            got = list(map(self.pieces.get, pieces))
            if None in got:
                for i, g in enumerate(got):
                    if g is None:  # looked up again: the same new piece may stand earlier in the text
                        got[i] = self.pieces.get(pieces[i]) or self._piece(pieces[i])
            lens[k] = sum(map(len, got))
            per_text.append(got)
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(per_text)), np.int64,
                           count=int(lens.sum()))
        return flat, lens

    def _piece(self, piece: str) -> tuple:
        if not piece.isascii() and self.unassigned.search(piece):
            return tuple(self.backend.encode(piece, add_special_tokens=False).ids)
        out = []
        parts = self.split_added.split(piece) if self.split_added is not None else [piece]
        for k, part in enumerate(parts):
            if k % 2:
                out.append(self.added[part])
                continue
            for word in (self.ascii_words if part.isascii() else self.words).findall(part):
                ids = self.word_ids.get(word)
                if ids is None:
                    mapped = word.encode().decode("latin-1").translate(self.bytes)
                    ids = tuple(t.id for t in self.model.tokenize(mapped))
                    if len(self.word_ids) >= MAX_WORDS:
                        self.word_ids.clear()
                    self.word_ids[word] = ids
                out += ids
        out = tuple(out)
        if len(piece) <= MAX_PIECE_CHARS:
            if len(self.pieces) >= MAX_PIECES:
                self.pieces.clear()
            self.pieces[piece] = out
        return out
