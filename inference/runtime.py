"""The fast speculative loop: static KV cache, chain and tree verification, batch > 1.

One round for every active request b (committed tokens t_1..t_n; the cache holds t_1..t_{n-1}, t_n is the
anchor the target has not processed yet, as in inference/generate.py):

    draft:    d = source.propose(context_b, k_b)       k_b from the request's K schedule, cut by the prefix scheduler
    group:    requests sorted by 1 + |d|, split where a separate forward costs less than the padding
    verify:   one forward per group over [anchor, d] (tree mask + depth positions for trees)
    accept:   verify.verify_chain (chains) / tree.accept_tree (trees)  -> accepted path, next token
    commit:   accepted path compacted to the slots after the anchor; lengths[b] += 1 + accepted

Plain decoding is the same loop with no source (k = 0), so "speedup" compares like with like.
tau = emitted tokens / verification forwards per request (bonus included, prefill excluded).
"""

from __future__ import annotations

import time
import torch
from torch import Tensor

from inference.generate import truncate_draft, eos_token_ids
from inference.kernels import accept_greedy_batched
from inference.llama import LlamaForward
from inference.sampling import SamplingConfig
from inference.schedulers import FixedK, VerifyCost, plan_groups
from inference.stats import DecodeStats, Generation
from inference.sources.base import Draft, DraftContext, DraftSource, mix_seeds, reset_source
from inference.tree import accept_tree, check_parents, draft_parents, tree_depths, tree_mask
from models.errors import DraftheadsError
from models.target import TargetOutput

EMPTY = torch.empty(0, dtype=torch.long)
# Padded tokens per prefill forward where decoding need not be row-invariant (regeneration): a SmolLM2 layer's
# activations for 2048 tokens (~6 MB in bf16) stay in cache, where one forward over 64 rows of ~380 tokens streamed
# ~150 MB per MLP through memory. The default slice's last batch (53 prompts of 201-382 tokens, bf16, 2 threads, AMX
# Xeon) prefilled in 9.6 s in one forward, 4.9 / 4.2 / 4.0 s in groups of 1024 / 2048 / 4096 tokens
PREFILL_TOKENS = 2048


def prefill_groups(n_ctx: list[int], max_tokens: int | None) -> list[tuple[int, int]]:
    """[a, b) ranges of consecutive requests, each prefilled in one forward padded to its longest n_ctx: all of them
    (max_tokens None), or as many as fit max_tokens padded tokens (at least one)."""
    if max_tokens is None:
        return [(0, len(n_ctx))]
    groups, start, longest = [], 0, 0
    for r, n in enumerate(n_ctx):
        if r > start and (r - start + 1) * max(longest, n) > max_tokens:
            groups.append((start, r))
            start, longest = r, 0
        longest = max(longest, n)
    return groups + [(start, len(n_ctx))]


def fitting_groups(members: list[int], drafts: dict[int, Draft], free: dict[int, int]) -> list[list[int]]:
    """One verify forward pads every member to the widest [anchor, draft]; a member with fewer free cache slots than
    that width (a long prompt near max_len) is verified on its own, where its own width fits (generate's check)."""
    width = 1 + max(drafts[b].size for b in members)
    tight = [b for b in members if free[b] < width]
    rest = [b for b in members if free[b] >= width]
    return [[b] for b in tight] + ([rest] if rest else [])


class Runtime:
    """A target behind a static KV cache for up to `batch_size` requests of up to `max_len` positions.

    CUDA path for decode/verify: cuda_graphs=True captures one CUDA graph per (rows, T) (GraphedForward,
    seconds to build), compile=True uses torch.compile(mode="reduce-overhead") (minutes to build, may fuse
    more). Either way the cache reads all max_len slots, so shapes never change with the context length.
    row_invariant=False trades bitwise decode == verify equality for faster decoding (inference/llama.py)."""

    def __init__(self, target, max_len: int = 2048, batch_size: int = 1, cuda_graphs: bool = False,
                 compile: bool = False, cost: VerifyCost | None = None, row_invariant: bool = True):
        self.target = target
        self.compiled = cuda_graphs or compile  # static shapes: pad verify widths to powers of two
        self.model = LlamaForward(target, pack_weights=not compile, row_invariant=row_invariant)  # inductor cannot read oneDNN-packed weights
        self.cache = self.model.new_cache(batch_size, max_len, static=self.compiled)
        self.forward = self.prefill = self.model.forward  # prefill shapes change with every prompt: eager
        if cuda_graphs:
            self.forward = GraphedForward(self.model)
        elif compile:
            for t in self.cache.k + self.cache.v + [self.cache.lengths]:
                torch._dynamo.mark_static_address(t)  # mutated in place: cudagraph-safe static buffers
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            step = torch.compile(_forward_tuple(self.model), mode="reduce-overhead", dynamic=False)
            self.forward = lambda *a, **kw: TargetOutput(*step(*a, **kw))
        self.eos = set(eos_token_ids(target))
        self.cost = cost  # verify cost curve; None = one padded forward per round
        self.device = target.device
        if self.device.type == "cuda" and row_invariant:  # cuBLAS may reduce a half-precision GEMM's split-K parts
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # in bf16, by row count
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
            torch.backends.cuda.matmul.allow_tf32 = False
        self.tokens = torch.zeros(batch_size, max_len + 1, dtype=torch.long)  # committed tokens, host side
        self._aux = self._final = None

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes

    def _features(self) -> tuple[Tensor, Tensor]:
        if self._aux is None:  # allocated once, on the first source that reads target features
            B, L = self.cache.batch_size, self.cache.max_len
            H, n = self.target.hidden_size, len(self.target.layer_ids)
            self._aux = torch.zeros(B, L, n * H, dtype=self.target.dtype, device=self.device)
            self._final = torch.zeros(B, L, H, dtype=self.target.dtype, device=self.device)
        return self._aux, self._final

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list, max_new: int, source: DraftSource | list[DraftSource] | None = None,
                 sampling: SamplingConfig = SamplingConfig(), k: int = 4, schedule=None, prefix=None,
                 seed: int = 0, ignore_eos: bool = False) -> Generation:
        """prompts: token-id lists (one per request). source: one DraftSource for all requests (stateless ones,
        e.g. prompt lookup) or a list with one per request (sources that cache per-request state, e.g. heads).
        schedule: () -> per-request K schedule (default FixedK(k)); prefix: ConfidencePrefix (cuts drafts).
        A source with an `observe(draft, emitted, verify_seconds)` method hears how each of its drafts fared."""
        B = len(prompts)
        if not 0 < B <= self.cache.batch_size:
            raise DraftheadsError(f"got {B} prompts for a runtime built for batch_size={self.cache.batch_size}; "
                                  f"pass between 1 and {self.cache.batch_size} prompts or build a bigger runtime")
        if max_new < 1:
            raise DraftheadsError(f"max_new={max_new}: ask for at least one new token")
        prompts = [torch.as_tensor(p, dtype=torch.long).flatten().cpu() for p in prompts]
        if min(p.numel() for p in prompts) == 0:
            raise DraftheadsError("an empty prompt was given; every request needs at least one token")
        longest = max(p.numel() for p in prompts)
        if longest + max_new + 1 > self.cache.max_len:
            raise DraftheadsError(f"prompt of {longest} tokens + max_new {max_new} does not fit the KV cache of "
                                  f"{self.cache.max_len} positions; build the Runtime with a larger max_len")
        per_request = isinstance(source, (list, tuple))  # one source per request (sources with state)
        if per_request and len(source) != B:
            raise DraftheadsError(f"got {len(source)} sources for {B} prompts; pass one source, or one per prompt")
        sources = list(source) if per_request else [source] if source is not None else []
        for b, s in enumerate(sources):
            reset_source(s, mix_seeds(seed, b) if per_request else seed)
        if prefix is not None:
            prefix.reset()
            for s in sources:
                getattr(s, "check_temperature", lambda t: None)(sampling.temperature)
        feats = any(getattr(s, "needs_features", False) for s in sources)
        aux, final = self._features() if feats else (None, None)
        schedules = [(schedule or (lambda: FixedK(k)))() for _ in range(B)]
        gen = torch.Generator(device=self.device).manual_seed(seed)
        stats = DecodeStats(k=k, requests=B)
        t_start = time.perf_counter()

        self.cache.reset()
        n_tok = [p.numel() for p in prompts]
        for b, p in enumerate(prompts):
            self.tokens[b, : p.numel()] = p
        self._prefill(prompts, aux, final)
        self._sync()
        stats.prefill_s = time.perf_counter() - t_start

        outputs: list[list[int]] = [[] for _ in range(B)]
        active = list(range(B))
        row_of = list(range(B))  # request -> cache row (_pack_rows moves requests as others finish)
        while active:
            # -- draft --
            drafts: dict[int, Draft] = {}
            for b in active:
                t0 = time.perf_counter()
                k_b = min(schedules[b].k, max_new - len(outputs[b]) - 1)
                draft = Draft(EMPTY)
                if sources and k_b > 0:
                    n = n_tok[b]
                    ctx = DraftContext(self.tokens[b, :n], aux[b, : n - 1] if feats else None,
                                       final[b, : n - 1] if feats else None)
                    draft = truncate_draft(sources[b if per_request else 0].propose(ctx, k_b, sampling), k_b,
                                           () if ignore_eos else self.eos)
                    if prefix is not None:
                        draft = prefix.truncate(draft, key=b)
                drafts[b] = draft
                self._sync()
                stats.draft_s += time.perf_counter() - t0

            # -- verify, one forward per draft-length group --
            sizes = [1 + drafts[b].size for b in active]
            groups = plan_groups(sizes, self.cost) if self.cost is not None else [list(range(len(active)))]
            free = {b: self.cache.max_len - self.cache_len(row_of[b]) for b in active}
            for members in (part for g in groups for part in fitting_groups([active[i] for i in g], drafts, free)):
                members = sorted(members, key=row_of.__getitem__)  # cache rows ascending (see KVCache.reader)
                t0 = time.perf_counter()
                results = self._verify_group(members, [row_of[b] for b in members], drafts, sampling, gen, aux, final)
                self._sync()
                dt = time.perf_counter() - t0
                stats.verify_s += dt
                stats.forwards += 1
                width = sum(1 + drafts[b].size for b in members)
                for b, (path, nxt) in zip(members, results):
                    draft = drafts[b]
                    emitted = [int(draft.tokens[i]) for i in path] + [nxt]
                    ended = False  # an end token on the draft's path: nothing below it was tested for the output
                    if not ignore_eos:  # a tree path through an end token: what follows it is never emitted
                        end = next((i + 1 for i, tok in enumerate(emitted) if tok in self.eos), len(emitted))
                        ended = end <= len(path)
                        emitted, path = emitted[:end], path[:end]
                    stats.record_round(draft.size, len(path), len(path) if ended else tested_depth(draft, path))
                    schedules[b].update(draft.size, len(path))
                    if prefix is not None and draft.parents is None:
                        prefix.update(draft.size, len(path), key=b)
                    observe = getattr(sources[b if per_request else 0], "observe", None) if sources else None
                    if observe is not None:  # empty drafts too: a source that often has nothing pays for it
                        observe(draft, len(emitted), dt * (1 + draft.size) / width)
                    for tok in emitted[: max_new - len(outputs[b])]:  # emitted already ends at an end token
                        self.tokens[b, n_tok[b]] = tok
                        n_tok[b] += 1
                        outputs[b].append(tok)
            active = [b for b in active if len(outputs[b]) < max_new
                      and (ignore_eos or not outputs[b] or outputs[b][-1] not in self.eos)]
            if not self.compiled:
                active = self._pack_rows(active, row_of)
        stats.emitted = sum(len(o) for o in outputs)
        stats.total_s = time.perf_counter() - t_start
        return Generation(outputs, stats)

    def _prefill(self, prompts: list[Tensor], aux: Tensor | None, final: Tensor | None) -> None:
        """prompt[:-1] of every request into the cache, right-padded (the last prompt token is its first anchor), and
        their target features into aux / final when given. A row-invariant runtime prefills all rows in one forward;
        the others (regeneration) in groups of consecutive rows of at most PREFILL_TOKENS padded tokens, each padded
        to its own longest prompt: activations that stay in the CPU's caches, and less padding (regeneration's
        prompts come sorted by length)."""
        n_ctx = [p.numel() - 1 for p in prompts]
        for a, b in prefill_groups(n_ctx, None if self.model.row_invariant else PREFILL_TOKENS):
            T = max(n_ctx[a:b])
            if T == 0:
                continue
            ids = torch.zeros(b - a, T, dtype=torch.long)
            for r in range(a, b):
                ids[r - a, : n_ctx[r]] = prompts[r][:-1]
            rows = self.cache.all_rows()[a:b]
            out = self.prefill(ids.to(self.device), self.cache, rows=rows, compute_logits=False)
            self.cache.commit(rows, torch.tensor(n_ctx[a:b], device=self.device))
            if aux is not None:
                for r in range(a, b):
                    aux[r, : n_ctx[r]] = out.aux_hidden[r - a, : n_ctx[r]]
                    final[r, : n_ctx[r]] = out.final_hidden[r - a, : n_ctx[r]]

    def _pack_rows(self, active: list[int], row_of: list[int]) -> list[int]:
        """The requests still decoding moved into cache rows 0..R-1 (row_of updated; the moves copy only the rows of
        requests that sat above R) and returned in row order, so that a forward over all of them reads the cache as one
        slice instead of gathering the live rows' keys and values in every layer (13-18% of a 64-row regeneration
        step on an AVX-512 Xeon). Outputs do not change: a request's row is storage, not part of its arithmetic."""
        R = len(active)
        holes = sorted(set(range(R)) - {row_of[b] for b in active})
        for b, hole in zip([b for b in active if row_of[b] >= R], holes):
            self.cache.move_row(row_of[b], hole)
            row_of[b] = hole
        return sorted(active, key=row_of.__getitem__)

    def _verify_group(self, members: list[int], cache_rows: list[int], drafts: dict[int, Draft], sampling, gen,
                      aux, final):
        """One target forward over [anchor, draft] of each member request (padded to the longest), whose keys and
        values sit in cache_rows; accept; commit."""
        R = len(members)
        if cache_rows != sorted(cache_rows):  # a static cache reads a full batch as rows 0..R-1, in that order
            raise AssertionError(f"verify rows {cache_rows} are not ascending")
        T = 1 + max(drafts[b].size for b in members)
        if self.compiled:  # a few input widths -> a few CUDA graphs
            T = min(1 << (T - 1).bit_length(), self.cache.max_len - max(self.cache_len(c) for c in cache_rows))
        ids = torch.zeros(R, T, dtype=torch.long)
        masks = torch.eye(T, dtype=torch.bool).repeat(R, 1, 1)  # pads see themselves only
        offsets = torch.arange(T).repeat(R, 1)
        any_tree = False
        for r, b in enumerate(members):
            d = drafts[b]
            n = 1 + d.size
            ids[r, 0] = self.tokens[b, self.cache_len(cache_rows[r])]  # the anchor
            ids[r, 1:n] = d.tokens.cpu()
            parents = draft_parents(d)
            if d.parents is not None:
                check_parents(parents)
                any_tree = True
                offsets[r, 1:n] = tree_depths(parents)
            masks[r, :n, :n] = tree_mask(parents)
        rows = torch.tensor(cache_rows, device=self.device)
        lengths = self.cache.lengths[rows].tolist()
        out = self.forward(ids.to(self.device), self.cache, tree_mask=masks.to(self.device),
                           position_offsets=offsets.to(self.device) if any_tree else None, rows=rows, verify=True)
        if sampling.greedy and not any_tree:  # all chains: one batched acceptance, one host sync
            lens = torch.tensor([drafts[b].size for b in members])
            n_acc, nxt_tok = accept_greedy_batched(ids[:, 1:].to(self.device), lens, out.logits)
            chain = list(zip(n_acc.tolist(), nxt_tok.tolist()))
        results = []
        for r, b in enumerate(members):
            d = drafts[b]
            if sampling.greedy and not any_tree:
                path, nxt = list(range(chain[r][0])), chain[r][1]
            else:
                path, nxt = accept_tree(d, out.logits[r, : 1 + d.size], sampling, gen)
            kept = torch.tensor([0] + [i + 1 for i in path], device=self.device)  # input rows that stay
            if d.parents is not None:
                self.cache.compact(cache_rows[r], lengths[r] + kept, lengths[r])
            if aux is not None:
                aux[b, lengths[r]: lengths[r] + kept.numel()] = out.aux_hidden[r, kept]
                final[b, lengths[r]: lengths[r] + kept.numel()] = out.final_hidden[r, kept]
            self.cache.commit(rows[r: r + 1], torch.tensor([kept.numel()], device=self.device))
            results.append((path, nxt))
        return results

    def cache_len(self, row: int) -> int:
        return int(self.cache.lengths[row])

    # ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def profile_cost(self, sizes=(1, 2, 4, 8, 16), context: int = 128, repeats: int = 7) -> VerifyCost:
        """Seconds for one forward of n tokens after `context` committed ones (median of repeats): the
        steps-per-second curve the confidence prefix scheduler and the group planner read. Run once at start-up, with
        the arguments a chain's verify passes (a compiled forward recompiles for any other call signature)."""
        context = min(context, self.cache.max_len - max(sizes) - 1)
        row = self.cache.all_rows()[:1]
        ids = torch.randint(0, self.target.vocab_size, (1, context + max(sizes)), device=self.device)
        self.cache.reset()
        self.prefill(ids[:, :context], self.cache, rows=row, compute_logits=False)
        self.cache.commit(row, torch.tensor([context], device=self.device))
        causal = {n: torch.ones(n, n, dtype=torch.bool, device=self.device).tril()[None] for n in sizes}
        for n in sizes:  # warm-up: every shape once (kernel creation) before anything is timed
            self.forward(ids[:, context: context + n], self.cache, tree_mask=causal[n], rows=row, verify=True)
        times = {n: [] for n in sizes}
        for _ in range(repeats):  # rounds over all sizes: a machine that drifts meanwhile shifts every size alike
            for n in sizes:
                t0 = time.perf_counter()
                self.forward(ids[:, context: context + n], self.cache, tree_mask=causal[n], rows=row, verify=True)
                self._sync()
                times[n].append(time.perf_counter() - t0)
        seconds = [sorted(times[n])[repeats // 2] for n in sizes]
        self.cache.reset()
        self.cost = VerifyCost(list(sizes), seconds)
        return self.cost


def tested_depth(draft: Draft, path: list[int]) -> int:
    """How deep a round compared drafts with the target: its accepted path, plus the depth below its last node
    where a child was rejected (none when that node is a leaf of the tree)."""
    parents = draft_parents(draft)
    last = path[-1] if path else -1
    return len(path) + int(bool((parents == last).any()))


def _forward_tuple(model: LlamaForward):
    """The verify forward returning a tuple (what torch.compile / CUDA graphs handle best)."""
    def step(input_ids, cache, tree_mask=None, position_offsets=None, rows=None, compute_logits=True, verify=True):
        out = model.forward(input_ids, cache, tree_mask=tree_mask, position_offsets=position_offsets, rows=rows,
                            compute_logits=compute_logits, verify=verify)
        return out.logits, out.aux_hidden, out.final_hidden

    return step


class GraphedForward:
    """One CUDA graph per (rows, T) around the static-cache forward: inputs are copied into static buffers,
    the graph replays, outputs live in static buffers until the next call (the runtime reads them first).
    On CPU the same buffers run eagerly (no capture), which is how the plumbing is tested without a GPU."""

    def __init__(self, model: LlamaForward):
        self.model = model
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = None

    def __call__(self, input_ids, cache, tree_mask=None, position_offsets=None, rows=None, compute_logits=True,
                 verify=True):  # every graphed forward is a decode / verify step
        R, T = input_ids.shape
        dev = input_ids.device
        rows = cache.all_rows()[:R] if rows is None else rows
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril().expand(R, T, T)
        position_offsets = torch.arange(T, device=dev).expand(R, T) if position_offsets is None else position_offsets
        if (R, T) not in self.graphs:
            self.graphs[(R, T)] = self._capture(cache, input_ids, tree_mask, position_offsets, rows)
        graph, inputs, outputs = self.graphs[(R, T)]
        for buf, new in zip(inputs, (input_ids, tree_mask, position_offsets, rows)):
            buf.copy_(new)
        if graph is None:
            outputs = self._run(cache, *inputs)
        else:
            graph.replay()
        return TargetOutput(*outputs)

    def _run(self, cache, ids, mask, offsets, rows):
        out = self.model.forward(ids, cache, tree_mask=mask, position_offsets=offsets, rows=rows, verify=True)
        return out.logits, out.aux_hidden, out.final_hidden

    def _capture(self, cache, *example):
        inputs = tuple(t.clone() for t in example)
        if inputs[0].device.type != "cuda":
            return None, inputs, None
        # warm-up on a side stream (writes only uncommitted slots, which the next forward overwrites anyway)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(cache, *inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self._run(cache, *inputs)
        return graph, inputs, outputs
