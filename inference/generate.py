"""The reference decoding loops: plain autoregressive and chain speculative decoding (batch 1).

Speculative round (one target forward per round):

    committed:  p1 .. pT            (KV cache holds p1 .. p{T-1}; pT is the "anchor", not yet processed)
    draft:      d1 .. dk            = source.propose(context, k)
    forward:    [pT, d1 .. dk]      -> logits [k+1, V], features [k+1, ...]
    verify:     n accepted, next    = verify_chain(...)
    commit:     d1 .. dn, next      (cache cropped back to p1 .. pT d1 .. dn; `next` is the new anchor)

The prompt is prefilled without its last token, so every emitted token comes out of a verification
forward and tau = emitted tokens / verification forwards exactly (bonus included, prefill excluded).
The same layout means the source always has target features for every committed token but the newest,
which is what `DraftContext` promises.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import Tensor
from transformers import DynamicCache

from inference.sampling import SamplingConfig
from inference.sources.base import Draft, DraftContext, DraftSource, reset_source
from inference.stats import DecodeStats, Generation
from inference.verify import verify_chain
from models.errors import DraftheadsError


def eos_token_ids(target) -> list[int]:
    """Every id the target treats as end of sequence (tokenizer, generation config, model config)."""
    ids: set[int] = set()
    gen_cfg = getattr(target.model, "generation_config", None)
    for v in (target.tokenizer.eos_token_id, getattr(gen_cfg, "eos_token_id", None), target.model.config.eos_token_id):
        if v is not None:
            ids.update([v] if isinstance(v, int) else v)
    return sorted(ids)


def _as_prompt(prompt_ids) -> Tensor:
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().cpu()  # [T]
    if prompt.numel() == 0:
        raise ValueError("empty prompt: decoding needs at least one token")
    return prompt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _crop(cache: DynamicCache, length: int) -> None:
    """Roll the KV cache back to its first `length` positions (negative crop = tokens to remove)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


@torch.no_grad()
def generate_plain(target, prompt_ids, max_new: int, sampling: SamplingConfig, seed: int = 0, eos_ids=None) -> list[int]:
    """Autoregressive decoding with the KV cache -> new tokens (stops after max_new or the first EOS)."""
    prompt = _as_prompt(prompt_ids)
    device = target.device
    eos = set(eos_token_ids(target) if eos_ids is None else eos_ids)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = DynamicCache(config=target.model.config)  # per-layer types (sliding window) from the config
    inputs = prompt[None].to(device)  # [1, T]
    out_tokens: list[int] = []
    while len(out_tokens) < max_new:
        out = target(inputs, past_key_values=cache, use_cache=True, compute_logits=False)
        logits = target.lm_head(out.final_hidden[0, -1])  # [V]
        token = int(sampling.sample(logits, generator))
        out_tokens.append(token)
        if token in eos:
            break
        inputs = torch.tensor([[token]], device=device)
    return out_tokens


@torch.no_grad()
def speculative_generate(
    target,
    source: DraftSource,
    prompt_ids,
    max_new: int,
    k: int,
    sampling: SamplingConfig,
    seed: int = 0,
    eos_ids=None,
) -> Generation:
    """Chain speculative decoding of one request; greedy output equals `generate_plain` token for token."""
    prompt = _as_prompt(prompt_ids)
    device = target.device
    eos = set(eos_token_ids(target) if eos_ids is None else eos_ids)
    generator = torch.Generator(device=device).manual_seed(seed)
    reset_source(source, seed)
    tokens, stats = [], DecodeStats(k=k, requests=1)

    seq = torch.empty(prompt.numel() + max_new + 1, dtype=torch.long)  # committed tokens, grows in place
    seq[: prompt.numel()] = prompt
    length = prompt.numel()
    # target features of committed tokens, filled as the cache grows (only when the source reads them)
    features = bool(getattr(source, "needs_features", False))
    aux = final = None
    if features:
        aux = torch.empty(seq.numel(), len(target.layer_ids) * target.hidden_size, device=device, dtype=target.dtype)
        final = torch.empty(seq.numel(), target.hidden_size, device=device, dtype=target.dtype)

    cache = DynamicCache(config=target.model.config)  # per-layer types (sliding window) from the config
    t_start = time.perf_counter()
    if length > 1:
        out = target(prompt[None, :-1].to(device), past_key_values=cache, use_cache=True, compute_logits=False)
        if features:
            aux[: length - 1] = out.aux_hidden[0]
            final[: length - 1] = out.final_hidden[0]
    _sync(device)
    stats.prefill_s = time.perf_counter() - t_start

    while len(tokens) < max_new and not (tokens and tokens[-1] in eos):
        # -- draft (never more than the round could emit) --
        t0 = time.perf_counter()
        k_round = min(k, max_new - len(tokens) - 1)
        draft = Draft(tokens=torch.empty(0, dtype=torch.long))
        if k_round > 0:
            ctx = DraftContext(seq[:length], aux[: length - 1] if features else None,
                               final[: length - 1] if features else None)
            draft = truncate_draft(source.propose(ctx, k_round, sampling), k_round, eos)
            if draft.parents is not None:
                raise DraftheadsError(f"source '{source.name}' proposed a token tree; this reference loop verifies "
                                      "chains only: configure the source for chains (e.g. tree=0) or use the tree runtime")
        _sync(device)
        t1 = time.perf_counter()

        # -- verify: one forward over [anchor, d1..dk] --
        inputs = torch.cat([seq[length - 1 : length], draft.tokens.cpu().long()])[None].to(device)  # [1, k+1]
        out = target(inputs, past_key_values=cache, use_cache=True)
        n, next_token = verify_chain(draft, out.logits[0], sampling, generator)
        _crop(cache, length + n)  # keep p1..pT d1..dn
        if features:
            aux[length - 1 : length + n] = out.aux_hidden[0, : n + 1]
            final[length - 1 : length + n] = out.final_hidden[0, : n + 1]
        _sync(device)
        verify_s = time.perf_counter() - t1
        stats.verify_s += verify_s
        stats.draft_s += t1 - t0
        stats.forwards += 1
        stats.record_round(draft.size, n, draft.size)
        if hasattr(source, "observe"):  # the feedback hook the runtime calls too (select:)
            source.observe(draft, n + 1, verify_s)
        for token in draft.tokens[:n].tolist() + [next_token]:
            seq[length] = token
            length += 1
            tokens.append(token)
            if token in eos or len(tokens) >= max_new:
                break
    stats.emitted = len(tokens)
    stats.total_s = time.perf_counter() - t_start
    return Generation([tokens], stats)


def truncate_draft(draft: Draft, k: int, eos=()) -> Draft:
    """A source may return more than asked; keep the first k (and their probs / confidences), and in a chain nothing
    after an end-of-turn token in `eos`: the answer ends there, so later drafts would be verified, and counted as
    accepted, for tokens never emitted."""
    if eos and draft.parents is None:
        k = next((i + 1 for i, t in enumerate(draft.tokens[:k].tolist()) if t in eos), k)
    if draft.size <= k:
        return draft
    cut = lambda t: None if t is None else t[:k]  # noqa: E731
    return replace(draft, tokens=draft.tokens[:k], probs=cut(draft.probs), confidences=cut(draft.confidences),
                   parents=cut(draft.parents))
