"""The reference speculative loop: greedy equality, tau with fake sources, EOS, features handed to sources."""

import pytest
import torch

from inference.generate import generate_plain, speculative_generate
from inference.sampling import SamplingConfig
from inference.sources.base import Draft
from inference.sources.prompt_lookup import PromptLookup

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def varied_target():
    """A tiny random Llama with untied, larger weights: its greedy output varies, so drafts get rejected."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.target import Target
    from models.tiny_tokenizer import tiny_byte_tokenizer

    tok = tiny_byte_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      initializer_range=0.2, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
    return Target(model, tok, "tiny-varied")


def prompts(n=3, length=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g) for _ in range(n)]


class Oracle:
    """Knows the plain greedy continuation; right for the first `right` draft positions, wrong after."""

    name = "oracle"
    needs_features = False

    def __init__(self, prompt_len, continuation, right=None, vocab=259):
        self.prompt_len, self.continuation, self.right, self.vocab = prompt_len, continuation, right, vocab

    def reset(self):
        pass

    def propose(self, ctx, k, sampling):
        done = ctx.tokens.numel() - self.prompt_len
        tokens = torch.tensor(self.continuation[done : done + k], dtype=torch.long)
        if self.right is not None:
            tokens[self.right :] = (tokens[self.right :] + 1) % self.vocab  # sure to differ from the target
        return Draft(tokens)


def per_depth(stats, k):
    return [stats.tested[j] for j in range(k)], [stats.accepted[j] for j in range(k)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equality_prompt_lookup(tiny_target, varied_target, k):
    for target in (tiny_target, varied_target):
        for prompt in prompts():
            plain = generate_plain(target, prompt, 40, GREEDY, eos_ids=[])
            spec = speculative_generate(target, PromptLookup(), prompt, 40, k, GREEDY, eos_ids=[])
            assert spec.tokens == [plain]
            stats = spec.stats
            assert stats.rounds == sum(stats.accept_hist.values()) == stats.forwards and stats.tau == 40 / stats.rounds


def test_prompt_lookup_accepts_on_repetitive_target(tiny_target):
    # the tied tiny model repeats its input: lookup drafts are mostly right, the varied one mostly wrong
    spec = speculative_generate(tiny_target, PromptLookup(), prompts()[0], 40, 4, GREEDY, eos_ids=[])
    assert spec.stats.tau > 3.0


def test_oracle_always_right_tau_is_k_plus_1(varied_target):
    prompt, k = prompts(1)[0], 4
    plain = generate_plain(varied_target, prompt, 30, GREEDY, eos_ids=[])
    spec = speculative_generate(varied_target, Oracle(20, plain), prompt, 30, k, GREEDY, eos_ids=[])
    assert spec.tokens == [plain]
    assert spec.stats.rounds == 6 and spec.stats.tau == k + 1
    assert spec.stats.accept_hist == {4: 6}
    assert per_depth(spec.stats, k) == ([6] * 4, [6] * 4)


def test_oracle_never_right_tau_is_1(varied_target):
    prompt = prompts(1)[0]
    plain = generate_plain(varied_target, prompt, 12, GREEDY, eos_ids=[])
    spec = speculative_generate(varied_target, Oracle(20, plain, right=0), prompt, 12, 3, GREEDY, eos_ids=[])
    assert spec.tokens == [plain]
    assert spec.stats.tau == 1.0 and spec.stats.rounds == 12
    # a round never drafts more than it could emit: k_round = min(k, tokens left - 1) -> 3 * 9 + 2 + 1 + 0
    assert spec.stats.proposed == 30 and spec.stats.accept_hist == {0: 12}
    assert per_depth(spec.stats, 3) == ([11, 0, 0], [0, 0, 0])


def test_oracle_sometimes_right_known_counts(varied_target):
    # right on 2 of 4 positions: every round emits 3 tokens; 15 tokens = 5 rounds with k_round 4,4,4,4,2
    prompt = prompts(1)[0]
    plain = generate_plain(varied_target, prompt, 15, GREEDY, eos_ids=[])
    spec = speculative_generate(varied_target, Oracle(20, plain, right=2), prompt, 15, 4, GREEDY, eos_ids=[])
    assert spec.tokens == [plain]
    assert spec.stats.tau == 3.0 and spec.stats.accept_hist == {2: 5} and spec.stats.proposed == 4 * 4 + 2
    assert per_depth(spec.stats, 4) == ([5, 5, 4, 0], [5, 5, 0, 0])


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_eos_truncates_like_plain(varied_target, k):
    prompt = prompts(1)[0]
    free = generate_plain(varied_target, prompt, 40, GREEDY, eos_ids=[])
    eos = free[17]
    stop = free.index(eos)
    plain = generate_plain(varied_target, prompt, 40, GREEDY, eos_ids=[eos])
    assert plain == free[: stop + 1]  # plain decoding keeps the EOS and stops there
    # the oracle makes EOS land inside accepted blocks (or as the bonus, depending on k)
    spec = speculative_generate(varied_target, Oracle(20, free), prompt, 40, k, GREEDY, eos_ids=[eos])
    assert spec.tokens == [plain]
    accepted = sum(n * c for n, c in spec.stats.accept_hist.items())  # no draft after the EOS proposed or counted
    assert accepted + spec.stats.rounds - 1 <= len(plain) and spec.stats.proposed <= len(plain)
    spec = speculative_generate(varied_target, PromptLookup(), prompt, 40, k, GREEDY, eos_ids=[eos])
    assert spec.tokens == [plain]


def test_default_eos_is_the_tokenizers(tiny_target):
    from inference.generate import eos_token_ids

    assert tiny_target.tokenizer.eos_token_id in eos_token_ids(tiny_target)


class FeatureRecorder:
    """Records the context it was given, to compare with a full forward of the committed tokens."""

    name = "recorder"
    needs_features = True

    def __init__(self):
        self.seen = []

    def reset(self):
        self.seen = []

    def propose(self, ctx, k, sampling):
        self.seen.append((ctx.tokens.clone(), ctx.aux_hidden.clone(), ctx.final_hidden.clone()))
        return PromptLookup().propose(ctx, k, sampling)


def test_sources_get_target_features_of_committed_tokens(tiny_target):
    recorder = FeatureRecorder()
    spec = speculative_generate(tiny_target, recorder, prompts(1)[0], 24, 3, GREEDY, eos_ids=[])
    assert len(recorder.seen) >= 2
    for tokens, aux, final in recorder.seen:
        assert aux.shape == (tokens.numel() - 1, 3 * tiny_target.hidden_size)  # features of tokens[:-1]
        full = tiny_target(tokens[None, :-1])
        torch.testing.assert_close(aux, full.aux_hidden[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final, full.final_hidden[0], atol=1e-4, rtol=1e-4)
    assert recorder.seen[-1][0].numel() < 20 + len(spec.tokens[0])


def test_sampling_is_seeded_and_runs_with_draft_probs(varied_target):
    sampling = SamplingConfig(temperature=0.8, top_k=50)

    class Sampler:  # draws its drafts from a fixed distribution and reports it
        name, needs_features = "sampler", False

        def reset(self):
            self.gen = torch.Generator().manual_seed(1)

        def propose(self, ctx, k, sampling):
            q = torch.softmax(torch.randn(k, 259, generator=self.gen), -1)
            return Draft(torch.multinomial(q, 1, generator=self.gen)[:, 0], q)

    prompt = prompts(1)[0]
    a = speculative_generate(varied_target, Sampler(), prompt, 30, 3, sampling, seed=5, eos_ids=[])
    b = speculative_generate(varied_target, Sampler(), prompt, 30, 3, sampling, seed=5, eos_ids=[])
    c = speculative_generate(varied_target, Sampler(), prompt, 30, 3, sampling, seed=6, eos_ids=[])
    assert a.tokens == b.tokens and a.tokens != c.tokens and len(a.tokens[0]) == 30


def test_edge_cases(tiny_target):
    one = torch.tensor([65])
    assert speculative_generate(tiny_target, PromptLookup(), one, 5, 4, GREEDY, eos_ids=[]).tokens == \
        [generate_plain(tiny_target, one, 5, GREEDY, eos_ids=[])]
    spec = speculative_generate(tiny_target, PromptLookup(), prompts(1)[0], 1, 8, GREEDY, eos_ids=[])
    assert len(spec.tokens[0]) == 1 and spec.stats.proposed == 0 and spec.stats.rounds == 1


def test_tree_drafts_are_refused_with_a_clear_error(tiny_target):
    from models.errors import DraftheadsError

    class TreeSource:
        name, needs_features = "tree", False

        def reset(self):
            pass

        def propose(self, ctx, k, sampling):
            return Draft(torch.tensor([1, 2]), parents=torch.tensor([-1, -1]))

    with pytest.raises(DraftheadsError, match="source 'tree' proposed a token tree"):
        speculative_generate(tiny_target, TreeSource(), prompts(1)[0], 8, 2, GREEDY)


@pytest.mark.slow
def test_greedy_equality_smollm2_prompt_lookup(smollm2):
    from data.chat import prompt_ids

    questions = ["Write a haiku about the sea, then explain each line.",
                 "List the first ten prime numbers and give a one-line proof that there are infinitely many."]
    for q in questions:
        ids = prompt_ids(smollm2.tokenizer, [{"role": "user", "content": q}])
        plain = generate_plain(smollm2, ids, 32, GREEDY)
        spec = speculative_generate(smollm2, PromptLookup(), ids, 32, 4, GREEDY)
        assert spec.tokens == [plain]
