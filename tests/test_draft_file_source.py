"""DraftFileSource: chain walk with confidences, prompt lookup first, tree drafts, tau on a tiny target."""

import pytest
import torch

from data.draft_file import DraftFile
from data.draft_file_build import build
from inference.generate import generate_plain, speculative_generate
from inference.sampling import SamplingConfig
from inference.sources.base import DraftContext
from inference.sources.draft_file import DraftFileSource, draft_file_source
from models.errors import DraftheadsError
from models.tiny_tokenizer import tiny_byte_tokenizer

TOK = tiny_byte_tokenizer()
GREEDY = SamplingConfig()


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def text(tokens):
    return TOK.decode(tokens.tolist())


@pytest.fixture(scope="module")
def fox_file(tmp_path_factory):
    """After 'the quick brown ' the corpus has 'fox jumps over the lazy dog' 3 times and 'cat sleeps' once."""
    d = tmp_path_factory.mktemp("fox")
    (d / "c").mkdir()
    for i in range(3):
        (d / "c" / f"fox{i}.txt").write_text("the quick brown fox jumps over the lazy dog\n")
    (d / "c" / "cat.txt").write_text("the quick brown cat sleeps\n")
    build([str(d / "c")], TOK, d / "fox.dfl", target_name="tiny-random-llama", vocab_size=len(TOK),
          orders=(1, 2, 3, 4), continuations=4, max_len=4, min_count=1, validation=0.0, log=lambda *_: None)
    return DraftFile(d / "fox.dfl")


def propose(source, context, k):
    return source.propose(DraftContext(torch.tensor(ids(context))), k, GREEDY)


def test_chain_walks_past_max_len_with_confidences(fox_file):
    source = DraftFileSource(fox_file, prompt_lookup=False)
    draft = propose(source, "the quick brown ", 8)  # max_len 4: needs two lookups for 8 tokens
    assert text(draft.tokens) == "fox jump"
    assert draft.probs is None and draft.parents is None
    torch.testing.assert_close(draft.confidences, torch.tensor([0.75, 1, 1, 1, 1, 1, 1, 1]))
    assert text(propose(source, "the quick brown c", 5).tokens) == "at sl"
    assert propose(source, "XXXX", 4).size == 0 and source.stats["none"] == 1


def test_prompt_lookup_goes_first_when_the_context_repeats(fox_file):
    source = DraftFileSource(fox_file)  # prompt lookup on, n-grams 3..2
    draft = propose(source, "brown owl. the quick brown ", 4)  # 'brown ' occurred earlier: copy what followed
    assert text(draft.tokens) == "owl." and source.stats["prompt"] == 1
    draft = propose(source, "a quick brown ", 4)  # no repeated 2-gram in the context: the file answers
    assert text(draft.tokens) == "fox " and source.stats["file"] == 1
    draft = propose(source, "XQ-ZQ", 3)  # no repeated 2-gram, 'Q' unknown to the file: 1-gram lookup copies
    assert text(draft.tokens) == "-ZQ" and source.stats["fallback"] == 1


def test_tree_draft_keeps_the_k_most_likely_nodes(fox_file):
    source = DraftFileSource(fox_file, prompt_lookup=False, tree=True)
    draft = propose(source, "the quick brown ", 6)
    # 'fox ' (path prob 0.75 each; max_len 4) is extended by the lookup of its own context: 'jump' (0.75 each)
    assert text(draft.tokens) == "fox ju"
    assert draft.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    torch.testing.assert_close(draft.confidences, torch.tensor([0.75, 1, 1, 1, 1, 1]))
    draft = propose(source, "the quick brown ", 12)  # then 'cat ' (0.25): two branches from the anchor
    assert text(draft.tokens) == "fox cat jump"
    assert draft.parents.tolist() == [-1, 0, 1, 2, -1, 4, 5, 6, 3, 8, 9, 10]
    torch.testing.assert_close(draft.confidences, torch.tensor([0.75, 1, 1, 1, 0.25, 1, 1, 1, 1, 1, 1, 1]))


def test_tau_on_a_tiny_target_with_its_own_outputs(tiny_target, tmp_path):
    """A file built from the target's greedy outputs predicts them: tau well above 1, output unchanged."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (12,), generator=g) for _ in range(4)]
    outputs = [generate_plain(tiny_target, p, 24, GREEDY) for p in prompts]
    build([], TOK, tmp_path / "own.dfl", target_name="tiny-random-llama", vocab_size=len(TOK), min_count=1,
          validation=0.0, token_docs=[p.tolist() + o for p, o in zip(prompts, outputs)], log=lambda *_: None)
    build([], TOK, tmp_path / "other.dfl", target_name="tiny-random-llama", vocab_size=len(TOK), min_count=1,
          validation=0.0, token_docs=[list(range(40, 90))], log=lambda *_: None)
    taus = {}
    for name in ("own", "other"):
        source = DraftFileSource(tmp_path / f"{name}.dfl", target=tiny_target, prompt_lookup=False)
        tokens = rounds = 0
        for p, plain in zip(prompts, outputs):
            res = speculative_generate(tiny_target, source, p, 24, 4, GREEDY)
            assert res.tokens == [plain]  # greedy speculative == greedy plain
            tokens, rounds = tokens + res.stats.emitted, rounds + res.stats.rounds
        taus[name] = tokens / rounds
    assert taus["own"] > 3.0 and taus["other"] < 1.3


def test_registry_factory(fox_file, tiny_target, tmp_path):
    source = draft_file_source(f"{fox_file.path},tree=1,prompt_lookup=0", tiny_target)
    assert source.tree and source.prompt is None and source.name == "draft_file"
    assert draft_file_source(str(fox_file.path), tiny_target).prompt.min_ngram == 2
    with pytest.raises(DraftheadsError, match="needs a file"):
        draft_file_source(None, tiny_target)
    with pytest.raises(DraftheadsError, match="does not exist"):
        draft_file_source(str(tmp_path / "missing.dfl"), tiny_target)
    with pytest.raises(DraftheadsError, match="KEY=VALUE"):
        draft_file_source(f"{fox_file.path},bogus=1", tiny_target)
