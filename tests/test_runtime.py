"""The runtime: compact Llama == HF, static cache, lossless chain/tree/batch decoding, T>0 distribution, memory."""

import copy

import pytest
import torch
import torch.nn.functional as F

from inference.generate import generate_plain
from inference.kv_cache import StaticKVCache
from inference.llama import LlamaForward, linear, pack_for_cpu
from inference.runtime import Runtime, prefill_groups
from inference.sampling import SamplingConfig
from inference.sources.base import Draft
from models.errors import DraftheadsError
from models.target import Target

GREEDY = SamplingConfig()


class OracleSource:
    """Proposes the known greedy continuation, wrong on purpose at some positions, with a draft length that
    varies with the context length (so requests in one batch draft different lengths); `tree` adds a wrong
    sibling before the right first token. Confidences: 0.9 for right tokens, 0.2 for wrong ones."""

    name = "oracle"

    def __init__(self, prompts, continuations, tree=False, needs_features=False):
        self.full = [list(p) + list(c) for p, c in zip(prompts, continuations)]
        self.prompts = [list(p) for p in prompts]
        self.tree, self.needs_features = tree, needs_features
        self.feature_rows = []

    def reset(self):
        pass

    def propose(self, ctx, k, sampling):
        toks = ctx.tokens.tolist()
        if self.needs_features:  # the runtime promises features for every committed token but the newest
            assert ctx.aux_hidden.shape[0] == len(toks) - 1 and ctx.final_hidden.shape[0] == len(toks) - 1
            self.feature_rows.append((toks, ctx.aux_hidden.clone(), ctx.final_hidden.clone()))
        full = next(f for p, f in zip(self.prompts, self.full) if toks[: len(p)] == p)
        n = len(toks)
        cont = full[n: n + 1 + n % k]
        right = [True] * len(cont)
        if n % 3 == 0 and len(cont) > 1:
            j = len(cont) // 2
            cont[j], right[j] = (cont[j] + 1) % 259, False
        conf = torch.tensor([0.9 if r else 0.2 for r in right])
        if not self.tree or not cont:
            return Draft(torch.tensor(cont, dtype=torch.long), confidences=conf)
        tokens = [(cont[0] + 7) % 259] + cont  # node 0: a wrong sibling of node 1
        parents = [-1, -1] + list(range(1, len(cont)))
        return Draft(torch.tensor(tokens), parents=torch.tensor(parents))


def make_prompts(lengths=(5, 17, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (n,), generator=g).tolist() for n in lengths]


def reference(target, prompts, max_new):
    return [generate_plain(target, p, max_new, GREEDY, eos_ids=[]) for p in prompts]


def test_llama_matches_hf(tiny_target):
    fwd = LlamaForward(tiny_target)
    ids = torch.randint(0, 259, (3, 20), generator=torch.Generator().manual_seed(0))
    ref = tiny_target(ids)
    cache = fwd.new_cache(3, 64)
    a = fwd(ids[:, :12], cache)
    cache.commit(cache.all_rows(), torch.tensor([12, 12, 12]))
    b = fwd(ids[:, 12:], cache)
    assert (torch.cat([a.logits, b.logits], 1) - ref.logits).abs().max() < 1e-5
    assert (torch.cat([a.aux_hidden, b.aux_hidden], 1) - ref.aux_hidden).abs().max() < 1e-5
    assert (torch.cat([a.final_hidden, b.final_hidden], 1) - ref.final_hidden).abs().max() < 1e-5
    # per-request lengths and a subset of rows: request 1 has 7 committed tokens, request 2 has 5
    for static in (False, True):
        cache = fwd.new_cache(3, 64, static=static)
        fwd(ids[:, :12], cache)
        cache.commit(cache.all_rows(), torch.tensor([12, 7, 5]))
        out = fwd(ids[1:, 12:16], cache, rows=torch.tensor([1, 2]))
        for r, n in ((1, 7), (2, 5)):
            full = tiny_target(torch.cat([ids[r: r + 1, :n], ids[r: r + 1, 12:16]], 1))
            assert (out.logits[r - 1] - full.logits[0, n:]).abs().max() < 1e-5


def test_cache_rollback_moves_lengths_only():
    cache = StaticKVCache(num_layers=2, batch_size=2, kv_heads=1, head_dim=4, max_len=8)
    ptrs = [t.data_ptr() for t in cache.k + cache.v]
    rows = cache.all_rows()
    cache.commit(rows, torch.tensor([5, 3]))
    cache.rollback(rows, torch.tensor([2, 9]))
    assert cache.lengths.tolist() == [2, 3] and [t.data_ptr() for t in cache.k + cache.v] == ptrs
    assert cache.nbytes == 2 * 2 * (2 * 1 * 8 * 4) * 4
    with pytest.raises(DraftheadsError, match="max_len"):
        cache.slots(rows, 6)


def test_plain_matches_reference_loop(tiny_target):
    prompts = make_prompts()
    rt = Runtime(tiny_target, max_len=128, batch_size=3)
    g = rt.generate(prompts, 24, ignore_eos=True)
    assert g.tokens == reference(tiny_target, prompts, 24)
    assert g.stats.tau == 1.0 and g.stats.rounds == 3 * 24


def test_fast_decode_attention_matches_reference_loop(tiny_target):
    """row_invariant=False (regeneration's decoding): float32 matmul attention over the real span, same greedy text."""
    prompts = make_prompts()
    rt = Runtime(tiny_target, max_len=128, batch_size=3, row_invariant=False)
    assert rt.generate(prompts, 24, ignore_eos=True).tokens == reference(tiny_target, prompts, 24)


def test_fast_bf16_decode_attention_matches_float32_attention():
    """MatmulAttention without exact rows (regeneration) in bfloat16, float32 GEMMs where the CPU emulates bf16:
    the float32 attention's output to bf16 precision, over the visible keys only."""
    from inference.llama import MatmulAttention

    g = torch.Generator().manual_seed(0)
    B, nh, kvh, T, S, hd = 3, 6, 2, 1, 40, 16
    q, k, v = (torch.randn(B, h, n, hd, generator=g) for h, n in ((nh, T), (kvh, S), (kvh, S)))
    mask = torch.rand(B, 1, T, S, generator=g) < 0.7
    got = MatmulAttention(mask, nh, kvh, hd, None)(q.bfloat16(), k.bfloat16(), v.bfloat16())
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(nh // kvh, 1), v.repeat_interleave(nh // kvh, 1),
                                          attn_mask=mask)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.03, atol=0.03)


def test_prefill_groups_fit_the_token_budget():
    assert prefill_groups([5, 9, 3], None) == [(0, 3)]
    assert prefill_groups([3, 4, 4, 5, 6, 20], 12) == [(0, 3), (3, 5), (5, 6)]  # 3 x 4 and 2 x 6 fit 12; 20 alone
    assert prefill_groups([0, 0], 1) == [(0, 2)]


def test_grouped_prefill_matches_reference_loop(tiny_target, monkeypatch):
    """row_invariant=False prefills groups of requests, each padded to its own longest prompt: same greedy text, and
    the features a source reads equal the target's own."""
    monkeypatch.setattr("inference.runtime.PREFILL_TOKENS", 12)  # prompts of 4, 16, 8 tokens to prefill: 3 groups
    prompts = make_prompts()
    ref = reference(tiny_target, prompts, 24)
    rt = Runtime(tiny_target, max_len=128, batch_size=3, row_invariant=False)
    assert len(prefill_groups([len(p) - 1 for p in prompts], 12)) == 3
    source = OracleSource(prompts, ref, needs_features=True)
    assert rt.generate(prompts, 24, source=source, k=3, ignore_eos=True).tokens == ref
    for toks, aux, final in source.feature_rows[:3]:  # each request's first round: its prompt's features
        full = tiny_target(torch.tensor([toks[:-1]]))
        assert (aux - full.aux_hidden[0]).abs().max() < 1e-4 and (final - full.final_hidden[0]).abs().max() < 1e-4


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_greedy_is_lossless_batched(tiny_target, tree):
    prompts = make_prompts()
    ref = reference(tiny_target, prompts, 40)
    rt = Runtime(tiny_target, max_len=128, batch_size=3)
    source = OracleSource(prompts, ref, tree=tree, needs_features=True)
    g = rt.generate(prompts, 40, source=source, k=5, ignore_eos=True)
    assert g.tokens == ref
    assert g.stats.tau > 2.0  # the oracle is right most of the time: far fewer rounds than tokens
    assert g.stats.rounds < 3 * 40 / 2
    # features handed to the source equal the target's own on the committed text (tree paths compacted)
    toks, aux, final = source.feature_rows[-1]
    full = tiny_target(torch.tensor([toks[:-1]]))
    assert (aux - full.aux_hidden[0]).abs().max() < 1e-4 and (final - full.final_hidden[0]).abs().max() < 1e-4


@pytest.mark.parametrize("tree", [False, True])
def test_requests_stopping_early_leave_the_others_lossless(tiny_target, tree):
    """Requests that stop at an end token drop out of the batch mid-run (the rest move into the lowest cache rows);
    every output equals the reference loop cut after its first end token."""
    prompts = make_prompts((5, 17, 9, 12), seed=3)
    ref = reference(tiny_target, prompts, 30)
    eos = {ref[0][0], ref[1][0]}  # requests 0 and 1 stop at once, 2 and 3 run on
    cut = [r[: next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in ref]
    assert [len(c) for c in cut] == [1, 1, 30, 30]
    rt = Runtime(tiny_target, max_len=128, batch_size=4)
    rt.eos = eos
    for source in (None, OracleSource(prompts, ref, tree=tree, needs_features=True)):
        g = rt.generate(prompts, 30, source=source, k=4)
        assert g.tokens == cut
    # requests 0, 1: their end token accepted, nothing after it counted (a chain is cut there before verifying)
    accepted = sum(n * c for n, c in g.stats.accept_hist.items())
    assert accepted == g.stats.emitted - g.stats.rounds + 2
    assert tree or g.stats.proposed < 4 * g.stats.rounds
    # requests 0, 1 alone: one round each, ended by the end token at depth 1: nothing below it counts as tested
    g = rt.generate(prompts[:2], 30, source=OracleSource(prompts[:2], ref[:2], tree=tree, needs_features=True), k=4)
    assert g.tokens == cut[:2] and g.stats.tested == g.stats.accepted == {0: 2}


def test_a_round_tests_the_depth_below_its_path_only_where_the_tree_goes_on():
    from inference.runtime import tested_depth

    tree = Draft(torch.tensor([5, 6, 7]), parents=torch.tensor([-1, -1, 0]))  # node 1 is a leaf, node 0 has a child
    assert [tested_depth(tree, p) for p in ([], [0], [1], [0, 2])] == [1, 2, 1, 2]
    chain = Draft(torch.tensor([5, 6, 7]))
    assert [tested_depth(chain, p) for p in ([], [0], [0, 1], [0, 1, 2])] == [1, 2, 3, 3]
    assert tested_depth(Draft(torch.tensor([], dtype=torch.long)), []) == 0


def test_requests_left_decoding_are_packed_into_one_cache_slice(tiny_target, monkeypatch):
    """Once requests 0 and 1 stop, requests 2 and 3 move into cache rows 0 and 1: every later forward reads the cache
    as one slice (no per-layer gather), and the text is the reference loop's, in float32 and in regeneration's
    decoding."""
    prompts = make_prompts((5, 17, 9, 12), seed=3)
    ref = reference(tiny_target, prompts, 30)
    eos = {ref[0][0], ref[1][0]}
    cut = [r[: next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in ref]
    reads = []
    reader = StaticKVCache.reader
    monkeypatch.setattr(StaticKVCache, "reader", lambda self, rows: reads.append(reader(self, rows)) or reads[-1])
    for row_invariant in (True, False):
        rt = Runtime(tiny_target, max_len=128, batch_size=4, row_invariant=row_invariant)
        rt.eos = eos
        reads.clear()
        assert rt.generate(prompts, 30).tokens == cut
        decode = reads[1:]  # after the prefill
        assert decode[0] == slice(0, 4) and all(r == slice(0, 2) for r in decode[1:]) and len(decode) == 30


def test_moved_cache_row_keeps_its_keys_values_and_length():
    cache = StaticKVCache(num_layers=2, batch_size=3, kv_heads=1, head_dim=2, max_len=4)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape))
    cache.commit(cache.all_rows(), torch.tensor([1, 2, 3]))
    before = [t[2, :, :3].clone() for t in cache.k + cache.v]
    cache.move_row(2, 0)
    assert cache.lengths.tolist() == [3, 2, 3]
    assert all(torch.equal(t[0, :, :3], b) for t, b in zip(cache.k + cache.v, before))
    assert cache.reader(torch.tensor([0, 1])) == slice(0, 2) and cache.reader(torch.tensor([1])) == slice(1, 2)
    assert torch.equal(cache.reader(torch.tensor([0, 2])), torch.tensor([0, 2]))


def test_one_source_per_request(tiny_target):
    prompts = make_prompts((6, 11), seed=2)
    ref = reference(tiny_target, prompts, 16)
    rt = Runtime(tiny_target, max_len=64, batch_size=2)
    sources = [OracleSource(prompts, ref, needs_features=True) for _ in prompts]
    assert rt.generate(prompts, 16, source=sources, k=3, ignore_eos=True).tokens == ref
    assert all(len(s.feature_rows) > 0 for s in sources)  # each request drafted with its own source
    with pytest.raises(DraftheadsError, match="one per prompt"):
        rt.generate(prompts, 4, source=sources[:1])


def test_grouped_batches_are_lossless(tiny_target):
    prompts = make_prompts((4, 30, 11, 7), seed=1)
    ref = reference(tiny_target, prompts, 30)
    rt = Runtime(tiny_target, max_len=128, batch_size=4)
    cost = rt.profile_cost(sizes=(1, 4, 16), context=16, repeats=3)
    assert cost.sizes == [1, 4, 16] and all(t > 0 for t in cost.seconds) and int(rt.cache.lengths.sum()) == 0
    # a cost that grows steeply with padded tokens forces several forwards per round
    from inference.schedulers import VerifyCost
    rt.cost = VerifyCost([1, 2, 64], [1.0, 1.5, 40.0])
    g = rt.generate(prompts, 30, source=OracleSource(prompts, ref), k=6, ignore_eos=True)
    assert g.tokens == ref and g.stats.forwards > g.stats.rounds / 4


def test_profiling_calls_the_forward_as_a_chain_verify_does(tiny_target):
    """A compiled forward (torch.compile, dynamic=False) recompiles the whole target for every new call signature: the
    cost profile must call it as verify does (a causal mask given, rows, no position offsets), or a --compile run
    compiles every width twice."""
    def signature(kw):
        mask = kw.get("tree_mask")
        given = tuple(sorted(k for k, v in kw.items() if v is not None))
        return given, None if mask is None else (mask.dtype, mask.dim())

    prompts = make_prompts((9,))
    rt = Runtime(tiny_target, max_len=64, batch_size=1)
    seen, forward = {"profile": set(), "generate": set()}, rt.forward
    phase = "profile"

    def spy(*args, **kw):
        seen[phase].add(signature(kw))
        return forward(*args, **kw)
    rt.forward = spy
    rt.profile_cost(sizes=(1, 2, 4), context=8, repeats=1)
    phase = "generate"
    rt.generate(prompts, 6, source=OracleSource(prompts, reference(tiny_target, prompts, 6)), k=3, ignore_eos=True)
    assert seen["profile"] and seen["profile"] <= seen["generate"], seen


def test_tree_cache_is_compacted(tiny_target):
    """After tree rounds the cache rows equal a fresh prefill of the committed text (paths moved in place)."""
    prompts = make_prompts((6,))
    ref = reference(tiny_target, prompts, 20)
    rt = Runtime(tiny_target, max_len=64, batch_size=1)
    g = rt.generate(prompts, 20, source=OracleSource(prompts, ref, tree=True), k=4, ignore_eos=True)
    n = rt.cache_len(0)
    committed = (prompts[0] + g.tokens[0])[:n]
    fresh = LlamaForward(tiny_target).new_cache(1, 64)
    LlamaForward(tiny_target)(torch.tensor([committed]), fresh)
    for layer in range(tiny_target.num_layers):
        assert (rt.cache.k[layer][0, :, :n] - fresh.k[layer][0, :, :n]).abs().max() < 1e-5
        assert (rt.cache.v[layer][0, :, :n] - fresh.v[layer][0, :, :n]).abs().max() < 1e-5


class SampledSource:
    """Samples k tokens from a fixed, deliberately wrong distribution q (uniform over 5 tokens) and reports q."""

    name, needs_features = "sampled", False

    def __init__(self, support, tree=False):
        self.q = torch.zeros(259)
        self.q[support] = 1 / len(support)
        self.support, self.tree = support, tree
        self.g = torch.Generator().manual_seed(1)

    def reset(self):
        pass

    def propose(self, ctx, k, sampling):
        if self.tree:  # three distinct point-mass children of the anchor, a chain of one below the first
            tokens = torch.tensor(self.support[:3] + [self.support[0]])
            return Draft(tokens, parents=torch.tensor([-1, -1, -1, 0]))
        tokens = torch.multinomial(self.q, k, replacement=True, generator=self.g)
        return Draft(tokens, probs=self.q.expand(k, -1).clone())


@pytest.mark.parametrize("tree", [False, True])
def test_sampling_matches_target_distribution(tiny_target, tree):
    """T>0: the first two emitted tokens follow the target's own distribution (top-5 sampling keeps the
    support small enough for 1,600 samples to resolve it)."""
    sampling = SamplingConfig(temperature=1.0, top_k=5)
    prompt = make_prompts((8,))[0]
    p1 = sampling.probs(tiny_target(torch.tensor([prompt])).logits[0, -1])  # [V]
    support = p1.topk(5).indices.tolist()
    rt = Runtime(tiny_target, max_len=32, batch_size=64)
    firsts, seconds = [], []
    source = SampledSource(support[::-1], tree=tree)
    for seed in range(25):
        g = rt.generate([prompt] * 64, 2, source=source, sampling=sampling, k=3, seed=seed, ignore_eos=True)
        firsts += [t[0] for t in g.tokens]
        seconds += [t[1] for t in g.tokens]
    emp1 = torch.bincount(torch.tensor(firsts), minlength=259).float() / len(firsts)
    assert 0.5 * (emp1 - p1).abs().sum() < 0.06
    x1 = support[0]
    p2 = sampling.probs(tiny_target(torch.tensor([prompt + [x1]])).logits[0, -1])
    after = torch.tensor([s for f, s in zip(firsts, seconds) if f == x1])
    emp2 = torch.bincount(after, minlength=259).float() / after.numel()
    assert after.numel() > 200 and 0.5 * (emp2 - p2).abs().sum() < 0.12


def test_memory_flat_over_2048_tokens(tiny_target):
    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    rt = Runtime(tiny_target, max_len=2100, batch_size=1)
    ptrs = [t.data_ptr() for t in rt.cache.k + rt.cache.v]
    prompt = make_prompts((16,))[0]
    rt.generate([prompt], 256, ignore_eos=True)  # warm-up: allocator pools
    before = rss_mb()
    g = rt.generate([prompt], 2048, ignore_eos=True)
    assert len(g.tokens[0]) == 2048 and rt.cache_len(0) == 16 + 2048 - 1
    assert [t.data_ptr() for t in rt.cache.k + rt.cache.v] == ptrs
    assert rt.kv_cache_bytes == 2 * 6 * 2100 * 2 * 16 * 4  # k+v, layers, slots, kv heads, head dim, fp32
    assert rss_mb() - before < 24


def test_user_errors(tiny_target):
    rt = Runtime(tiny_target, max_len=32, batch_size=2)
    with pytest.raises(DraftheadsError, match="max_len"):
        rt.generate([list(range(3, 30))], 16)
    with pytest.raises(DraftheadsError, match="batch_size=2"):
        rt.generate([[5], [6], [7]], 4)
    with pytest.raises(DraftheadsError, match="max_new=0: ask for at least one"):  # it ran a round emitting nothing
        rt.generate([[5]], 0)


@pytest.mark.parametrize("tree", [False, True])
def test_static_graph_path_is_lossless(tiny_target, tree):
    """cuda_graphs=True on CPU runs the GraphedForward buffers without capture: static cache reads,
    power-of-two verify widths, one buffer set per (rows, T)."""
    prompts = make_prompts((5, 9, 14))
    ref = reference(tiny_target, prompts, 20)
    rt = Runtime(tiny_target, max_len=64, batch_size=3, cuda_graphs=True)
    g = rt.generate(prompts, 20, source=OracleSource(prompts, ref, tree=tree, needs_features=True), k=3,
                    ignore_eos=True)
    assert g.tokens == ref and all(T in (1, 2, 4, 8) for _, T in rt.forward.graphs)
    # a verify cost that groups the whole batch, whose planner orders members by draft size: the full batch is read
    # as cache rows 0..2 in order, so its members must come in that order (they came permuted: other rows' keys)
    from inference.schedulers import VerifyCost

    rt.cost = VerifyCost([1, 64], [1.0, 1.0001])
    g = rt.generate(prompts, 20, source=OracleSource(prompts, ref, tree=tree, needs_features=True), k=3,
                    ignore_eos=True)
    assert g.tokens == ref


@pytest.mark.parametrize("graphs", [False, True])
def test_a_cache_row_near_full_verifies_beside_longer_drafts(tiny_target, graphs):
    """max_len = longest prompt + max_new + 1, the least generate accepts: near the end the long prompt's row has
    fewer free slots than a short prompt's draft is wide, so one padded forward over both would overrun its row
    (an error on the dynamic path, a shape error on the static one); the runtime verifies it on its own."""
    class Continuation:  # the reference continuation (all accepted: the long prompt races ahead) or all of it wrong
        name, needs_features = "continuation", False

        def __init__(self, full, wrong):
            self.full, self.wrong = full, wrong

        def reset(self):
            pass

        def propose(self, ctx, k, sampling):
            n = ctx.tokens.numel()
            return Draft(torch.tensor([(t + self.wrong) % 259 for t in self.full[n: n + k]], dtype=torch.long))

    prompts = make_prompts((30, 4))
    ref = reference(tiny_target, prompts, 16)
    rt = Runtime(tiny_target, max_len=30 + 16 + 1, batch_size=2, cuda_graphs=graphs)
    sources = [Continuation(p + r, wrong) for p, r, wrong in zip(prompts, ref, (0, 1))]
    g = rt.generate(prompts, 16, source=sources, k=4, ignore_eos=True)
    assert g.tokens == ref


@pytest.mark.slow
def test_compiled_runtime_is_lossless(tiny_target):
    """torch.compile(mode='reduce-overhead') on CPU (inductor; ~1 min of compiling)."""
    prompts = make_prompts((5, 9))
    ref = reference(tiny_target, prompts, 12)
    rt = Runtime(tiny_target, max_len=64, batch_size=2, compile=True)
    g = rt.generate(prompts, 12, source=OracleSource(prompts, ref), k=3, ignore_eos=True)
    assert g.tokens == ref


@pytest.mark.slow
def test_smollm2_runtime_matches_hf_greedy(smollm2):
    """The real target: our forward's logits == HF's, and 16 greedy tokens equal `generate_plain`."""
    prompt = smollm2.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    ref_logits = smollm2(torch.tensor([prompt])).logits
    fwd = LlamaForward(smollm2)
    out = fwd(torch.tensor([prompt]), fwd.new_cache(1, 64))
    assert (out.logits - ref_logits).abs().max() < 1e-3
    rt = Runtime(smollm2, max_len=64)
    assert rt.generate([prompt], 16, ignore_eos=True).tokens[0] == generate_plain(smollm2, prompt, 16, GREEDY, eos_ids=[])


def test_packed_cpu_weights_match_f_linear(monkeypatch):
    import inference.llama

    monkeypatch.setattr(inference.cpu_kernels, "intel_cpu", lambda: False)  # float32 packs on other CPUs than Intel's
    g = torch.Generator().manual_seed(0)  # sums of 32 products ~ N(0, 32): oneDNN and MKL differ by float32 ulps
    w, b, x = torch.randn(48, 32, generator=g), torch.randn(48, generator=g), torch.randn(3, 5, 32, generator=g)
    packed = pack_for_cpu(w)
    assert packed.is_mkldnn
    torch.testing.assert_close(linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(linear(xb[0, :1], wb), linear(xb[0, :3], wb)[:1])  # a row alone == the row among others
    packed = pack_for_cpu(wb)
    if getattr(packed, "is_mkldnn", False):  # bf16 packed for oneDNN: bitwise F.linear for every row count
        for rows in (1, 2, 3, 5, 17, 33, 64):
            xr = torch.randn(rows, 32, generator=g).bfloat16()
            assert torch.equal(linear(xr, packed, b.bfloat16()), linear(xr, wb, b.bfloat16()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projections_equal_the_separate_linears(dtype, monkeypatch):
    """q/k/v (and gate/up) as one packed GEMM give bitwise the separate packed GEMMs' outputs, in decode's 1 row as in
    verify's many (SmolLM2's shapes, with biases as Qwen2 has them)."""
    import inference.llama
    from inference.llama import ROW_BLOCK, Projections

    monkeypatch.setattr(inference.cpu_kernels, "intel_cpu", lambda: False)  # float32 packs on other CPUs than Intel's
    g = torch.Generator().manual_seed(0)
    mods = [torch.nn.Linear(576, n, bias=True).to(dtype) for n in (576, 192, 192)]
    for m in mods:
        m.weight.data = (torch.randn(m.weight.shape, generator=g) * 0.05).to(dtype)
    fused, separate = Projections(mods, pack=True), [(pack_for_cpu(m.weight), m.bias) for m in mods]
    assert len(fused.parts) == 1 or not inference.llama.packs_for_cpu(mods[0].weight)
    with torch.no_grad():
        for rows in (1, 2, 5, 16, 33):
            x = torch.randn(1, rows, 576, generator=g).to(dtype)
            for a, (w, b) in zip(fused(x, lambda x, w, b: linear(x, w, b, ROW_BLOCK)), separate):
                assert torch.equal(a, linear(x, w, b, ROW_BLOCK)), rows


@pytest.fixture(scope="module")
def tiny_bf16(tiny_target):
    return Target(copy.deepcopy(tiny_target.model).to(torch.bfloat16), tiny_target.tokenizer, "tiny-bf16")


@pytest.fixture(params=["compiled", "matmul"])
def decode_attention(request, monkeypatch):
    """The runtime's CPU forward with the compiled kernels (inference/cpu_kernels.py) or, where they were not built,
    torch's ops and MatmulAttention's GEMMs."""
    from inference import cpu_kernels

    if request.param == "compiled":
        assert cpu_kernels.supported("cpu", torch.bfloat16, 4, 2, 8, 64), (
            "inference/_cpu_kernels.c was not compiled: install a C compiler and the Python headers, then "
            "`pip install -e .`")
    else:  # what an install without a C compiler runs
        monkeypatch.setenv("DRAFTHEADS_CPU_KERNELS", "0")
        assert not cpu_kernels.enabled()
    return request.param


@pytest.mark.parametrize("prompt_len", [32, 252, 508])  # the 5-token block crosses key spans 256 and 512
def test_bfloat16_token_decoded_alone_equals_verified_in_block(tiny_bf16, prompt_len, decode_attention):
    """Bitwise: 5 tokens decoded one by one get the logits that one 5-token verify forward gives them."""
    fwd = LlamaForward(tiny_bf16)
    ids = torch.randint(0, 259, (1, prompt_len + 5), generator=torch.Generator().manual_seed(3))
    caches = [fwd.new_cache(1, 1024) for _ in range(2)]
    for cache in caches:
        fwd(ids[:, :prompt_len], cache)
        cache.commit(cache.all_rows(), torch.tensor([prompt_len]))
    one_by_one = []
    for j in range(prompt_len, prompt_len + 5):
        one_by_one.append(fwd(ids[:, j:j + 1], caches[0]).logits[0, -1])
        caches[0].commit(caches[0].all_rows(), torch.tensor([1]))
    assert torch.equal(torch.stack(one_by_one), fwd(ids[:, prompt_len:], caches[1]).logits[0])


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("k", [5, 24])
def test_bfloat16_speculative_equals_plain_runtime(tiny_bf16, tree, k, decode_attention):
    """k=24: verify steps of up to 26 tokens take the decode path too (it was taken up to 16 only; wider steps went
    through SDPA and unblocked GEMMs, and bf16 outputs left the plain ones)."""
    prompts = make_prompts((7, 30, 12, 50, 9), seed=1)
    rt = Runtime(tiny_bf16, max_len=256, batch_size=5)
    plain = rt.generate(prompts, 120, ignore_eos=True).tokens
    g = rt.generate(prompts, 120, source=OracleSource(prompts, plain, tree=tree), k=k, ignore_eos=True)
    assert g.tokens == plain and g.stats.tau > 2.0


def test_first_source_falls_back_and_stays_lossless(tiny_target):
    from inference.sources import build_source, source_layer_ids, source_paths
    from inference.sources.first import FirstSource
    from inference.sources.prompt_lookup import PromptLookup

    prompts = make_prompts((6, 11), seed=4)
    ref = reference(tiny_target, prompts, 24)
    heads = [OracleSource(prompts, ref, needs_features=True) for _ in prompts]
    sources = [FirstSource([PromptLookup(), h], "first:test") for h in heads]
    assert all(s.needs_features for s in sources)
    g = Runtime(tiny_target, max_len=64, batch_size=2).generate(prompts, 24, source=sources, k=3, ignore_eos=True)
    assert g.tokens == ref and all(len(h.feature_rows) > 0 for h in heads)  # the fallback drafted some rounds
    assert isinstance(build_source("first:prompt_lookup+prompt_lookup:min_ngram=1", tiny_target), FirstSource)
    assert source_layer_ids("first:prompt_lookup+prompt_lookup") is None
    spec = "first:prompt_lookup:max_ngram=4+draft_file:a/b.dfl+head:h1,tree=1+head:h2"  # what a τ row hashes
    assert source_paths(spec) == ["a/b.dfl", "h1", "h2"]
    with pytest.raises(DraftheadsError, match="two or more sources"):
        build_source("first:prompt_lookup", tiny_target)


def test_bf16_decode_linears_give_a_row_the_same_bits_in_any_batch():
    """A row's output of a bfloat16 decode / verify linear does not depend on how many rows share the GEMM (an AMX
    Xeon's GEMM rounded 33+ rows differently from 2-32; ROW_BLOCK keeps every GEMM within one kernel's range)."""
    from inference.llama import ROW_BLOCK, linear

    g = torch.Generator().manual_seed(0)
    for out_features in (1536, 8192):
        w = (torch.randn(out_features, 576, generator=g) * 0.05).bfloat16()
        x = torch.randn(3 * ROW_BLOCK + 1, 576, generator=g).bfloat16()
        alone = torch.cat([linear(x[i: i + 1], w) for i in range(len(x))])
        for n in (2, ROW_BLOCK, ROW_BLOCK + 1, 2 * ROW_BLOCK + 5, len(x)):
            assert torch.equal(linear(x[:n], w, row_block=ROW_BLOCK), alone[:n]), n
        assert torch.equal(linear(x[None, :40], w, row_block=ROW_BLOCK)[0], alone[:40])  # [B, T, H] inputs too


def test_compiled_bf16_linear_rounds_once_and_gives_a_row_the_same_bits_in_any_batch():
    """inference/cpu_kernels.py linear_bf16 (CPUs without native bfloat16): within one bf16 step of the float64
    product (plus a float32 sum's rounding), and a row's bits the same alone, among 2-70 rows, on 1 or 2 threads, with or without a bias."""
    from inference import cpu_kernels

    if not (cpu_kernels.enabled() and cpu_kernels._c.has_avx2_fma()):
        pytest.skip("needs the compiled kernels on an AVX2 + FMA CPU")
    g = torch.Generator().manual_seed(0)
    for n, k in ((1536, 576), (13, 40)):  # SmolLM2's gate; a width that leaves a partial tile
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        b = torch.randn(n, generator=g).bfloat16()
        x = torch.randn(70, k, generator=g).bfloat16()
        for bias in (None, b):
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            got = cpu_kernels.linear_bf16(x, w, bias)
            ulp = exact.abs().clamp_min(1e-30).log2().floor().exp2() * 2**-7  # a bf16 step at the exact value
            float32_sum = 2**-20 * (x.double().abs() @ w.double().abs().T)  # the float32 sum's own rounding
            assert ((got.double() - exact).abs() <= ulp + float32_sum).all()
            alone = torch.cat([cpu_kernels.linear_bf16(x[i: i + 1], w, bias) for i in range(len(x))])
            threads = torch.get_num_threads()
            try:
                for t in (1, 2):
                    torch.set_num_threads(t)
                    for rows in (2, 3, 5, 17, 70):
                        assert torch.equal(cpu_kernels.linear_bf16(x[:rows], w, bias), alone[:rows]), (t, rows)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(cpu_kernels.linear_bf16(x[None, :6], w, bias)[0], alone[:6])  # [B, T, K] inputs


@pytest.mark.parametrize("L", [300, 480, 700, 1000])  # the tree's span one SPAN_BLOCK longer than the decode's
@pytest.mark.parametrize("kind", ["matmul", "compiled"])
def test_matmul_attention_ignores_where_the_keys_sit(L, kind):
    """A query decoded alone (its keys contiguous, 1 row) gets bitwise the output it gets as row j of a 9-row tree
    verification whose ancestors sit at scattered slots, with a longer span and other rows around it (bfloat16),
    through MatmulAttention and through the compiled kernel."""
    from inference.cpu_kernels import CompiledAttention
    from inference.llama import GEMM_MIN_ROWS, SPAN_BLOCK
    from inference.llama import MatmulAttention as Matmul

    MatmulAttention = Matmul if kind == "matmul" else (lambda mask, nh, kvh, hd, rows: CompiledAttention(mask, hd))

    g = torch.Generator().manual_seed(0)
    nh, kvh, hd, dt = 9, 3, 64, torch.bfloat16
    rows = -(-GEMM_MIN_ROWS // (nh // kvh))
    keys, values = (torch.randn(1, kvh, L + 4, hd, generator=g).to(dt) for _ in range(2))
    q = torch.randn(1, nh, 1, hd, generator=g).to(dt)
    span = -(-(L + 4) // SPAN_BLOCK) * SPAN_BLOCK
    alone_mask = torch.zeros(1, 1, 1, span, dtype=torch.bool)
    alone_mask[..., : L + 4] = True
    pad_keys = lambda t, S: torch.cat([t, torch.zeros(1, kvh, S - t.shape[2], hd, dtype=dt)], 2)  # noqa: E731
    alone = MatmulAttention(alone_mask, nh, kvh, hd, rows)(q, pad_keys(keys, span), pad_keys(values, span))

    T, S, slots = 9, span + SPAN_BLOCK, [1, 4, 5, 8]  # the last 4 keys (3 ancestors + itself) at new-token slots
    k_tree, v_tree = (torch.randn(1, kvh, S, hd, generator=g).to(dt) for _ in range(2))
    k_tree[:, :, :L], v_tree[:, :, :L] = keys[:, :, :L], values[:, :, :L]
    mask = torch.ones(1, 1, T, S, dtype=torch.bool).tril(L)  # other rows: a chain over the committed keys
    mask[0, 0, 8] = False
    mask[0, 0, 8, :L] = True
    for i, s in enumerate(slots):
        k_tree[:, :, L + s], v_tree[:, :, L + s] = keys[:, :, L + i], values[:, :, L + i]
        mask[0, 0, 8, L + s] = True
    q_tree = torch.randn(1, nh, T, hd, generator=g).to(dt)
    q_tree[:, :, 8] = q[:, :, 0]
    in_tree = MatmulAttention(mask, nh, kvh, hd, rows)(q_tree, k_tree, v_tree)[:, :, 8:]
    assert torch.equal(alone, in_tree)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_attention_matches_matmul_attention(dtype):
    """The compiled kernel computes what MatmulAttention computes (to float32 rounding) for 2 requests of 1, 5 and 16
    new tokens over a tree mask, with strided cache views and GQA (9 query heads over 3 key/value heads)."""
    from inference.cpu_kernels import CompiledAttention
    from inference.llama import MatmulAttention

    g = torch.Generator().manual_seed(1)
    nh, kvh, hd, S = 9, 3, 64, 96
    cache_k, cache_v = (torch.randn(2, kvh, 128, hd, generator=g).to(dtype) for _ in range(2))
    for T in (1, 5, 16):
        q = torch.randn(2, T, nh, hd, generator=g).to(dtype).transpose(1, 2)  # the layout decoding passes
        mask = torch.rand(2, 1, T, S, generator=g) < 0.6
        mask[..., 0] = True  # every query sees at least one key
        want = MatmulAttention(mask, nh, kvh, hd, 3)(q, cache_k[:, :, :S], cache_v[:, :, :S])
        got = CompiledAttention(mask, hd)(q, cache_k[:, :, :S], cache_v[:, :, :S])
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rms_norm_and_rope_match_torch(dtype):
    """The runtime's one-call RMSNorm equals models.layers.rms_norm to an ulp of the dtype, and a row's output does
    not depend on the rows beside it; its RoPE is bitwise the torch formula's, on the strided q of a fused projection."""
    from inference import cpu_kernels
    from models.layers import rms_norm

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 7, 576, generator=g) * 4).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    got = cpu_kernels.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, rms_norm(x, w, 1e-5), atol=0, rtol=1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(cpu_kernels.rms_norm(x[1, 4:5], w, 1e-5), got[1, 4:5])
    qkv = torch.randn(2, 5, 13 * 64, generator=g).to(dtype)  # [B, T, (9 + 2 * 2) heads * hd]
    q = qkv[..., : 9 * 64].view(2, 5, 9, 64).transpose(1, 2)
    cos, sin = (torch.randn(2, 1, 5, 64, generator=g).to(dtype) for _ in range(2))
    from models.layers import rotate_half

    assert torch.equal(cpu_kernels.rope(q, cos, sin), q * cos + rotate_half(q) * sin)
