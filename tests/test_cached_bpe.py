"""The cached byte-level BPE encoder (data/cached_bpe.py) gives the fast tokenizer's own ids: on every Unicode code
point in contexts that probe each cut and word rule, on text and code, and through a draft-file build in worker
processes. The tokenizer is trained here in memory (GPT-2's pre-tokenizer, real merges), so nothing is downloaded."""

import json
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from data.cached_bpe import PROBE, CachedByteLevelBPE
from models.tiny_tokenizer import tiny_byte_tokenizer

TEXT = (PROBE + "def main(argv=None):\n    for i in range(10):\n        print(f'{i:>3} items')  # loop\n"
        "The quick brown fox jumps over the lazy dog. It's 2026; we'll see what they've done.\n") * 20


@pytest.fixture(scope="module")
def gpt2_style():
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                   additional_special_tokens=specials)


def hf_ids(tok, texts):
    return [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def test_cached_encoder_equals_the_tokenizer_on_text(gpt2_style):
    enc = CachedByteLevelBPE.of(gpt2_style)
    assert enc is not None
    texts = [TEXT, PROBE, "", " ", "\n\n", "x" * 1000 + " " + "ab" * 300, "<|im_start|>a<|im_end|>b<|endoftext|>"]
    for _ in range(2):  # cold, then from the caches
        assert [ids.tolist() for ids in enc.encode(texts)] == hf_ids(gpt2_style, texts)
    assert len(enc.pieces) > 50 and len(enc.word_ids) > 50
    flat, lens = enc.encode_flat(texts)
    assert lens.tolist() == [len(i) for i in hf_ids(gpt2_style, texts)] and len(flat) == lens.sum()


@pytest.mark.parametrize("context", ["1{c}'s", "x{c} y", "a {c}  b", ".{c}.", "{c}{c} 1", "'{c}ll", "{c}\n\n x"])
def test_cached_encoder_equals_the_tokenizer_on_every_code_point(gpt2_style, context):
    """Whitespace (Unicode's, without U+001C-1F), letters and numbers, unassigned code points: each context puts
    the character where one rule decides (a cut, a contraction, a class run, a whitespace look-ahead)."""
    enc = CachedByteLevelBPE.of(gpt2_style)
    cps = [c for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF][::3]  # a third: the suite's time
    texts = [context.replace("{c}", chr(c)) for c in cps]
    ref, mine = hf_ids(gpt2_style, texts), enc.encode(texts)
    bad = [hex(c) for c, r, m in zip(cps, ref, mine) if r != m.tolist()]
    assert not bad, f"{len(bad)} code points differ, e.g. {bad[:10]}"


def test_cached_encoder_refuses_other_tokenizers(gpt2_style):
    from tokenizers import normalizers

    assert CachedByteLevelBPE.of(tiny_byte_tokenizer()) is None  # ByteLevel without GPT-2's regex
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(gpt2_style.backend_tokenizer.to_str()))
    other.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert CachedByteLevelBPE.of(other) is None


def test_build_with_worker_processes_equals_one_process(gpt2_style, tmp_path, monkeypatch):
    """A corpus over POOL_CHARS is tokenized by 2 spawned workers: the file is the single-process build's, byte
    for byte."""
    import data.draft_file_build as b

    import data.draft_file_tokenize as t

    corpus = tmp_path / "corpus.jsonl"
    lines = TEXT.splitlines()
    corpus.write_text("".join(json.dumps({"text": "\n".join(lines[i: i + 7])}) + "\n" for i in range(len(lines))))
    monkeypatch.setattr(t, "BATCH_CHARS", 2048)  # many batches in flight
    files, reports = {}, {}
    for name, pool_chars in (("one", 1 << 40), ("two", 0)):
        monkeypatch.setattr(b, "POOL_CHARS", pool_chars)
        reports[name] = b.build([str(corpus)], gpt2_style, tmp_path / f"{name}.dfl", target_name="t",
                                vocab_size=len(gpt2_style), threads=2, log=lambda *_: None)
        files[name] = (tmp_path / f"{name}.dfl").read_bytes()
    assert reports["one"]["keys"] > 100 and reports["one"]["tokens"] > 10_000
    assert files["one"] == files["two"]
