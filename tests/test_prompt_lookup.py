"""Prompt lookup matching and the source registry."""

import pytest
import torch

from inference.sampling import SamplingConfig
from inference.sources import SOURCES, build_source, register_source
from inference.sources.base import DraftContext
from inference.sources.prompt_lookup import PromptLookup
from models.errors import DraftheadsError


def propose(tokens, k=4, **kw):
    return PromptLookup(**kw).propose(DraftContext(torch.tensor(tokens)), k, SamplingConfig()).tokens.tolist()


def test_longest_suffix_wins_over_a_more_recent_short_match():
    # suffix [1, 2, 3]: the 3-gram occurs at the start (followed by 10, 11); "3" alone recurs later (followed by 20)
    assert propose([1, 2, 3, 10, 11, 3, 20, 9, 1, 2, 3], k=2) == [10, 11]


def test_most_recent_match_among_equal_lengths():
    assert propose([5, 6, 1, 5, 6, 2, 5, 6], k=1) == [2]


def test_copy_runs_past_the_context_like_lz77():
    # [7, 1, 2, 1, 2]: suffix [1, 2] last seen at 1..2, continuation wraps around with period 2
    assert propose([7, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]
    assert propose([9, 9, 9], k=3) == [9, 9, 9]


def test_no_match_or_tiny_context_gives_empty_draft():
    assert propose([1, 2, 3, 4]) == []
    assert propose([1]) == []
    assert propose([1, 2, 1], k=0) == []


def test_min_ngram_excludes_short_matches():
    tokens = [4, 8, 1, 2, 4]  # only a 1-gram match ([4] -> 8)
    assert propose(tokens, k=2) == [8, 1]
    assert propose(tokens, k=2, min_ngram=2) == []


def test_returns_at_most_k_point_mass_tokens():
    draft = PromptLookup().propose(DraftContext(torch.arange(10).repeat(3)), 4, SamplingConfig())
    assert draft.tokens.tolist() == [0, 1, 2, 3] and draft.probs is None and draft.tokens.dtype == torch.long


def test_build_source_parses_arguments():
    src = build_source("prompt_lookup:max_ngram=5,min_ngram=2", target=None)
    assert isinstance(src, PromptLookup) and (src.max_ngram, src.min_ngram) == (5, 2)
    assert build_source("prompt_lookup", None).max_ngram == 3


@pytest.mark.parametrize("spec, message", [
    ("nonsense", "unknown draft source 'nonsense'; known sources: .*prompt_lookup"),
    ("prompt_lookup:max_n=3", "'max_n=3' is not KEY=VALUE with KEY in"),
    ("prompt_lookup:max_ngram=three", "max_ngram='three' is not a valid int"),
    ("prompt_lookup:max_ngram=1,min_ngram=2", "1 <= min_ngram <= max_ngram"),
])
def test_build_source_errors_name_the_input(spec, message):
    with pytest.raises(DraftheadsError, match=message):
        build_source(spec, None)


def test_registering_a_source_is_one_line():
    try:
        register_source("fixed", lambda arg, target: PromptLookup(max_ngram=int(arg)))
        assert build_source("fixed:7", None).max_ngram == 7
        SOURCES["lazy"] = "inference.sources:prompt_lookup_source"  # imported on first use
        assert build_source("lazy:max_ngram=4", None).max_ngram == 4
        SOURCES["missing"] = "no_such_module:factory"
        with pytest.raises(DraftheadsError, match="'missing' is registered as 'no_such_module:factory' but cannot"):
            build_source("missing", None)
    finally:
        for name in ("fixed", "lazy", "missing"):
            SOURCES.pop(name, None)
