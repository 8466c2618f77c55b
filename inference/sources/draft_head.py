"""A trained draft head (P-EAGLE parallel, EAGLE-3 chain, Medusa) as a DraftSource: spec "head:DIR".

It reads the target features of the committed tokens (ctx.aux_hidden, or ctx.final_hidden for Medusa), keeps a
cache of the head's depth-1 keys/values while the context only grows, and returns the draft tokens with the
distributions they were sampled from under the ONE SamplingConfig, so the verifier's lossless rule applies.
Parallel heads draft all k tokens in one forward; slot k's distribution does not depend on the tokens drafted
before it, which the lossless rule allows (it only needs each token drawn from the q it reports).
"""

from __future__ import annotations

import torch

from inference.sampling import SamplingConfig
from inference.sources.base import Draft, DraftContext
from models.checkpoint import load_draft
from models.errors import DraftheadsError
from models.peagle import DraftCache


class DraftHeadSource:
    needs_features = True

    def __init__(self, head, name: str, seed: int = 0):
        self.head, self.name = head, name
        self.cache = DraftCache()
        self.generator = torch.Generator(device=next(head.parameters()).device).manual_seed(seed)

    def reset(self) -> None:
        self.cache.reset()

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int, sampling: SamplingConfig) -> Draft:
        feats = getattr(ctx, self.head.feature)
        if feats is None:
            raise DraftheadsError(f"draft source '{self.name}' needs the target's {self.head.feature} for the context; "
                                  "run it through the runtime with feature capture (sources with needs_features=True)")
        k = min(k, self.head.k)
        if k <= 0 or ctx.tokens.numel() < 2:
            return Draft(ctx.tokens.new_zeros(0))
        drafted = []

        def sample_fn(draft_logits):  # chain heads feed each sampled token back
            tok = sampling.sample(self.head.full_vocab_logits(draft_logits.float())[None], self.generator)[0]
            drafted.append(tok)
            return tok

        logits = self.head.full_vocab_logits(
            self.head.draft_logits(ctx.tokens, feats, self.cache, k, sample_fn).float())  # [k, V]
        tail = sampling.sample(logits[len(drafted):], self.generator)  # parallel: all k; chain: the last one
        tokens = torch.cat([torch.stack(drafted), tail]) if drafted else tail
        probs = None if sampling.greedy else sampling.probs(logits)
        return Draft(tokens.long(), probs)


def head_source(arg: str | None, target) -> DraftHeadSource:
    """Factory for the source registry: 'head:DIR' (a directory written by training: out_dir/head)."""
    if not arg:
        raise DraftheadsError("draft source 'head' needs a checkpoint directory: write head:DIR (e.g. head:outputs/run/head)")
    return DraftHeadSource(load_draft(arg, target), f"head:{arg}")
