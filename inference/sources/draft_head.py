"""A trained draft head (P-EAGLE parallel, EAGLE-3 chain, Medusa) as a DraftSource: spec "head:DIR[,tree=1,depth=D]".

It reads the target features of the committed tokens (ctx.aux_hidden, or ctx.final_hidden for Medusa), keeps a
cache of the head's depth-1 keys/values while the context only grows, and returns the draft tokens with the
distributions they were sampled from under the ONE SamplingConfig, so the verifier's lossless rule applies.
Parallel heads draft all k tokens in one forward; slot k's distribution does not depend on the tokens drafted
before it, which the lossless rule allows (it only needs each token drawn from the q it reports).
"""

from __future__ import annotations

import torch

from inference.sampling import SamplingConfig
from inference.sources.base import Draft, DraftContext, mix_seeds
from inference.tree import best_first_tree
from models.checkpoint import load_draft
from models.errors import DraftheadsError
from models.families import family
from models.peagle import DraftCache


DRAFT_STREAM = 0x5DEECE66D  # mixed into a head source's seed


class DraftHeadSource:
    needs_features = True

    def __init__(self, head, name: str, seed: int = 0, tree: bool = False, depth: int | None = None):
        if tree and not family(head.family_name).tree:
            raise DraftheadsError(f"draft source '{name}': tree=1 needs a head that drafts its positions independently "
                                  f"(P-EAGLE with parallel: true, or Medusa); this {head.family_name} head drafts one "
                                  "chain, so drop tree=1")
        if depth is not None and not 1 <= depth <= head.k:
            raise DraftheadsError(f"draft source '{name}': depth={depth} must be between 1 and the head's K={head.k}")
        self.head, self.name, self.tree, self.depth = head, name, tree, depth or head.k
        self.cache = DraftCache()
        # a stream of its own: the runtime seeds its acceptance draws with the run's seed, and one stream shared by
        # both would reuse the draft's noise as the acceptance and residual noise (on CUDA, draw for draw)
        self.seed = seed
        self.generator = torch.Generator(device=next(head.parameters()).device).manual_seed(seed ^ DRAFT_STREAM)

    def reset(self) -> None:
        self.cache.reset()

    def seed_draws(self, seed: int) -> None:
        """Draws from (this source's seed, the run's seed): the same run on the same source repeats itself."""
        self.generator.manual_seed(mix_seeds(self.seed, seed) ^ DRAFT_STREAM)

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int, sampling: SamplingConfig) -> Draft:
        feats = getattr(ctx, self.head.feature)
        if feats is None:
            raise DraftheadsError(f"draft source '{self.name}' needs the target's {self.head.feature} for the context; "
                                  "run it through the runtime with feature capture (sources with needs_features=True)")
        if k <= 0 or ctx.tokens.numel() < 2:
            return Draft(ctx.tokens.new_zeros(0))
        if self.tree:
            return self._tree(ctx.tokens, feats, k, sampling)
        k = min(k, self.head.k)
        drafted = []

        def sample_fn(draft_logits):  # chain heads feed each sampled token back
            tok = sampling.sample(self.head.full_vocab_logits(draft_logits.float())[None], self.generator)[0]
            drafted.append(tok)
            return tok

        logits, confidences = self._draft(ctx.tokens, feats, k, sample_fn)
        logits = self.head.full_vocab_logits(logits.float())  # [k, V]
        tail = sampling.sample(logits[len(drafted):], self.generator)  # parallel: all k; chain: the last one
        tokens = torch.cat([torch.stack(drafted), tail]) if drafted else tail
        probs = None if sampling.greedy else sampling.probs(logits)
        return Draft(tokens.long(), probs, None if confidences is None else confidences.float())

    def _draft(self, tokens, feats, k: int, sample_fn):
        """(logits [k, V_draft], confidences [k] or None) for the k tokens after `tokens`; sample_fn(logits) -> id is
        called for every token a later row depends on (chain heads), in order."""
        return self.head.draft_logits(tokens, feats, self.cache, k, sample_fn), None

    def _tree(self, tokens, feats, nodes: int, sampling: SamplingConfig) -> Draft:
        depth = min(self.depth, nodes)
        logits = self.head.full_vocab_logits(self.head.draft_logits(tokens, feats, self.cache, depth, None).float())
        logp = torch.log_softmax(logits, -1) if sampling.greedy else sampling.probs(logits).log()  # [depth, V]
        tree_tokens, parents = best_first_tree(logp, nodes)
        return Draft(tree_tokens.to(tokens.device), parents=parents)


def head_source(arg: str | None, target) -> DraftHeadSource:
    """Factory for the source registry: 'head:DIR' or 'head:DIR,tree=1,depth=5' (DIR written by training: out_dir/head)."""
    from inference.sources import parse_kwargs, path_and_options

    path, rest = path_and_options(arg)
    if not path:
        raise DraftheadsError("draft source 'head' needs a checkpoint directory: write head:DIR (e.g. head:outputs/run/head)")
    kw = parse_kwargs(rest, f"head:{arg}", {"tree": int, "depth": int})
    return DraftHeadSource(load_draft(path, target), f"head:{arg}", tree=bool(kw.get("tree", 0)), depth=kw.get("depth"))
