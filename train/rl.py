"""Stage 2: acceptance-rate RL, on-policy, through the same loop as stage 1 (train/loop.py run_stage).

One step, for B sequences of the feature set:
  1. pick up to rl_anchors distinct anchors a inside the trained (assistant) span, a + 2 <= rl_max_context: uniformly,
     or (train.rl_anchor_policy=round_starts) among the round starts of the greedy chain the head runs now, the
     positions greedy serving drafts from (train/chain.py);
  2. sample a block y_1..y_K from the current head at each anchor (chain heads feed their samples back);
  3. the frozen target scores every block of a sequence in ONE teacher-forced forward: the context once, then the
     blocks side by side, block m seeing the context up to its anchor and itself (a forest, as in tree
     verification) -> p_k. So 16 blocks cost about one context forward, not 16;
  4. recompute the head's q_k with gradients (teacher-forcing the sampled tokens: training == inference
     numerics, tests/test_peagle.py) and maximise
        E[accepted] = sum_k alpha_k prod_{i<k} r_i,   alpha_k = sum_v min(p_k, q_k),   r_i = min(1, p_i(y_i)/q_i(y_i))
     (pathwise, low variance): depth k counts when y_1..y_{k-1} were accepted, which along a block drawn from q has
     probability prod r_i, and then accepts with alpha_k. Unbiased for the exact rule's count, unlike
     sum_k prod_{j<=k} alpha_j, which reads alpha_k after prefixes drawn from q rather than accepted ones (p_k and a
     chain head's q_k depend on the prefix; README: the objective before 2026-12-05's fix). Depths after a drafted
     end-of-turn token count nothing (the runtime cuts the draft there). At T > 0 the blocks are draws from the
     head, so its gradient is the pathwise one plus the draws' score term (draw_score; before 2026-12-06 it was
     left out, which biased the gradient for K >= 2)
      + rl_pg_weight * REINFORCE on R = tokens accepted by the exact rule (min(1, p/q) then first rejection),
        baseline = mean R of the other blocks of the step (stateless, so resume stays exact): optional, 0 by
        default (it misses R's pathwise part, so it is not E[R]'s gradient either)
      - rl_kl_weight * KL(q_stage1 || q)  (anchor to the stage-1 head)
      + confidence_weight * BCE(c_k, alpha_k at T=1) for heads with a confidence head (DSpark): the head it gates
        draft lengths with keeps learning the acceptance of the drafts RL changes, on the blocks themselves.
The serving temperature is train.rl_temperature, else train.temperature.end (training and validation alike: the
schedule is a distillation device, not a serving one). At 0
(greedy serving) blocks are the head's argmax and p is one-hot at the target's argmax, so alpha_k = q_k(target argmax)
with q at train.rl_surrogate_temperature: 1 is the head's own distribution; below 1 alpha approaches the 0/1 greedy
acceptance and its gradient concentrates on near misses (the target's token just below the head's argmax), the
cases one step can flip. There is no REINFORCE term at 0 (the blocks are not samples of q); the KL anchor stays at T=1.
Held out (rl_validation_fn), steps 1-4 without the loss run on every held-out sequence at fixed seeds: the
objective itself (val_expected_accepted, val_reward, val_alpha_k), logged next to stage 1's val_tau_est and
val_tau_chain (train.val_tau_chain).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from inference.generate import eos_token_ids
from inference.llama import LlamaForward, compact_forward
from inference.sampling import SamplingConfig
from inference.verify import acceptance_rates, accepts
from models.families import family
from models.errors import DraftheadsError
from models.peagle import DraftCache
from train.chain import round_start_mask
from train.cod import CodPlan
from train.distributed import full_parameters
from train.loop import Shard, Stage, Tally, run_stage
from train.trainer import batch_indices, collate, soft_label_validation, token_fields

BLOCK_SEED = 2_000_003
HOLDOUT_SEED = 1_000_000_007  # rl_validation_fn's draws: offset far past any training micro-step


def check_rl_target(target) -> None:
    if target.sharded:
        raise DraftheadsError("RL scores drafts with the whole target on each rank; a sharded target (accelerate=fsdp "
                              "or zero3 with several processes) is not supported there yet: use accelerate=ddp or zero2")


def frozen_copy(head, target):
    """The stage-1 reference: same class and weights, no gradients (shared target modules re-attached, not copied)."""
    ref = family(head.family_name).head(**head.config)
    ref.load_state_dict(head.state_dict())
    return ref.to(device=target.device, dtype=target.dtype).attach_target(target).eval().requires_grad_(False)


def pick_anchors(item: dict, n: int, max_context: int, g: torch.Generator, among: Tensor | None = None) -> list[int]:
    """Up to n distinct anchors a (sorted, drawn uniformly) whose first draft token x_{a+2} is a trained token,
    a + 2 <= max_context; `among` (bool [L]) narrows the candidates."""
    L = len(item["input_ids"])
    idx = torch.arange(L)
    ok = (idx + 2 < L) & (idx + 2 <= max_context)
    ok &= item["loss_mask"][(idx + 2).clamp(max=L - 1)].bool()
    cand = (ok if among is None else ok & among).nonzero().squeeze(1)
    return sorted(cand[torch.randperm(cand.numel(), generator=g)[:n]].tolist())


def round_starts(model, target, items: list[dict], k: int, max_context: int, device) -> list[Tensor]:
    """bool [L] per sequence: train.chain.round_start_mask over the sequence's first max_context tokens."""
    cut = [{key: v[:max_context] if torch.is_tensor(v) and v.dim() and v.shape[0] == len(it["input_ids"]) else v
            for key, v in it.items()} for it in items]
    mask = round_start_mask(model, target, collate(cut, device), k)
    starts = [torch.zeros(len(it["input_ids"]), dtype=torch.bool) for it in items]
    for b, (s, c) in enumerate(zip(starts, cut)):
        s[:len(c["input_ids"])] = mask[b, :len(c["input_ids"])]
    return starts


def block_plan(anchors: Tensor, valid: Tensor, k: int) -> CodPlan:
    """anchors [B, M] (sorted per row; padding repeats the last one), valid [B, M] -> the plan: depth-1 tokens for
    every context anchor 0..max a_b, and depths 1..K trained for each valid block anchor."""
    B, M = anchors.shape
    top = torch.where(valid, anchors, torch.zeros_like(anchors)).amax(1)  # [B] last anchor of each row
    W = int(top.max()) + 1
    a1 = torch.arange(W).expand(B, W)
    hit = torch.zeros(B, W, dtype=torch.bool)
    hit[torch.arange(B)[:, None].expand(B, M)[valid], anchors[valid]] = True
    cols_a, cols_d, cols_v, cols_t, cols_p = [a1], [torch.ones(B, W, dtype=torch.long)], [a1 <= top[:, None]], [hit], \
        [torch.full((B, W), -1)]
    blocks = [0, W]
    for d in range(2, k + 1):
        cols_a.append(anchors)
        cols_d.append(torch.full((B, M), d))
        cols_v.append(valid)
        cols_t.append(valid)
        cols_p.append(anchors if d == 2 else torch.arange(M).expand(B, M) + blocks[-2])
        blocks.append(blocks[-1] + M)
    return CodPlan(*(torch.cat(c, 1) for c in (cols_a, cols_d, cols_v, cols_t, cols_p)), blocks)


def exact_accepted(p_tok: Tensor, q_tok: Tensor, g: torch.Generator, live: Tensor | None = None) -> Tensor:
    """R [B]: tokens accepted by the lossless rule (accept y_k w.p. min(1, p/q); stop at the first rejection, and
    after an end-of-turn draft: `live` [B, K], see drafted)."""
    u = torch.rand(p_tok.shape, generator=g).to(p_tok.device)
    ok = accepts(u, p_tok, q_tok)
    return (ok if live is None else ok & live).long().cumprod(1).sum(1)


def drafted(y: Tensor, eos: Tensor) -> Tensor:
    """live [B, K]: depth k is drafted, i.e. no end-of-turn token among y_1..y_{k-1} (the runtime cuts a chain draft
    after its first one: the answer ends there)."""
    ended = torch.isin(y, eos.to(y.device)).long().cumsum(1)  # end-of-turn tokens among y_1..y_k
    return torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], 1) == 0


def accepted_terms(alpha: Tensor, p_tok: Tensor, q_tok: Tensor, live: Tensor | None = None) -> Tensor:
    """[B, K]: alpha_k prod_{i<k} min(1, p_i(y_i) / q_i(y_i)), 0 where not drafted; their sum is E[tokens accepted] of
    blocks drawn from q, for the acceptance rates alpha [B, K] and the target's and head's probabilities of the drawn
    tokens p_tok, q_tok [B, K] (at T=0, p one-hot at the target's argmax: prod_{i<k} is 1 while the head's argmax
    chain agrees, else 0)."""
    ratio = (p_tok / q_tok.clamp_min(torch.finfo(q_tok.dtype).tiny)).clamp(max=1)
    reached = torch.cat([torch.ones_like(ratio[:, :1]), ratio[:, :-1].cumprod(1)], 1)
    return alpha * reached if live is None else alpha * reached * live


def expected_accepted(alpha: Tensor, p_tok: Tensor, q_tok: Tensor, live: Tensor | None = None) -> Tensor:
    """[B]: the sum of accepted_terms."""
    return accepted_terms(alpha, p_tok, q_tok, live).sum(1)


def draw_score(terms: Tensor, log_q_tok: Tensor) -> Tensor:
    """[B], value 0: the score-function part of the gradient of E[accepted] for blocks drawn from the head (T > 0).
    accepted_terms depend on the draw y_i through the terms after it, so d/dtheta E_y[f] = E[df] (pathwise) +
    E[sum_i (sum_{k>i} term_k - b_i) d log q_i(y_i)], b_i the mean of the other blocks' (independent of this draw);
    without it the gradient is biased for K >= 2. `terms` [B, K] (their values are used, not their graph)."""
    later = (terms.flip(1).cumsum(1).flip(1) - terms).detach()  # sum_{k>i} term_k
    n = later.shape[0]
    baseline = (later.sum(0, keepdim=True) - later) / (n - 1) if n > 1 else torch.zeros_like(later)
    score = ((later - baseline) * log_q_tok).sum(1)
    return score - score.detach()


@torch.no_grad()
def score_blocks(model: LlamaForward, contexts: list[Tensor], anchors: Tensor, y: Tensor) -> Tensor:
    """Target logits [B, M, K, V] for the blocks y [B, M, K] drafted after anchors [B, M] of contexts (token ids,
    context b ends at token max_m a_bm + 1): logits k of block m are the target's next-token scores after
    x_0..x_{a+1}, y_1..y_{k-1}. One forward for the contexts, one for all blocks (tree verification's masks)."""
    B, M, K = y.shape
    dev = y.device
    width = max(c.numel() for c in contexts)
    cache = model.new_cache(B, width + M * (K - 1))
    rows = cache.all_rows()
    ids = torch.zeros(B, width, dtype=torch.long, device=dev)
    for b, c in enumerate(contexts):
        ids[b, : c.numel()] = c
    first = model(ids, cache, rows=rows, logits_at=anchors + 1).logits  # [B, M, V]: after x_{a+1}
    if K == 1:
        return first[:, :, None].float()
    cache.commit(rows, torch.tensor([c.numel() for c in contexts], device=dev))
    j = torch.arange(K - 1, device=dev)
    block = torch.arange(M, device=dev).repeat_interleave(K - 1)  # [T] block of each new token
    step = j.repeat(M)  # [T] its index inside the block
    tree = (block[:, None] == block[None]) & (step[None] <= step[:, None])  # [T, T] query sees key
    pos = (anchors.repeat_interleave(K - 1, 1) + 2 + step)  # [B, T] y_{j+1} sits at a + 2 + j
    rest = model(y[:, :, : K - 1].reshape(B, -1), cache, tree_mask=tree.expand(B, -1, -1),
                 position_offsets=pos - cache.lengths[:, None], rows=rows,
                 context_limit=anchors.repeat_interleave(K - 1, 1) + 2).logits  # [B, M*(K-1), V]
    return torch.cat([first[:, :, None], rest.view(B, M, K - 1, -1)], 2).float()


@dataclass
class Rollout:
    """One on-policy draw: N valid blocks of K tokens sampled from the head, scored by the target and the head."""
    batch: dict  # the head's inputs (block_batch) with its plan: the KL term re-runs the reference on them
    plan: CodPlan
    anchors: Tensor  # [B, M]
    valid: Tensor  # [B, M]
    y: Tensor  # [N, K] the sampled tokens of the valid blocks
    q_t: float  # the head's softmax temperature in log_q: the serving T, or 1 when serving greedily
    log_q: Tensor  # [N, K, V] the head's log-probs at q_t; grads when enabled
    alpha: Tensor  # [N, K] sum_v min(p_k, q_k)
    live: Tensor  # [N, K] depth k is drafted (no end of turn drawn before it)
    confidence: Tensor | None  # [N, K] a DSpark head's confidence logits when training (grad enabled), else None
    survive: Tensor | None  # [N, K] their label: sum_v min(p_k, q_k) at T=1 on the full vocabulary
    terms: Tensor  # [N, K] alpha_k prod_{i<k} min(1, p_i/q_i) on the drawn tokens (0 past an end of turn)
    expected: Tensor  # [N] their sum: E[accepted]
    reward: Tensor  # [N] tokens accepted by the exact rule
    tokens: int  # context + block tokens the target read


def rollout(model, core, scorer: LlamaForward, items: list[dict], anchor_lists: list[list[int]], tc, k: int,
            serve_t: float, g: torch.Generator, device, autocast=contextlib.nullcontext) -> Rollout:
    """Steps 2-4 of the module docstring for the sequences `items` at their sorted `anchor_lists`, up to the loss: the
    head's q keeps its graph when grad is enabled (training); the draws (blocks, then the exact rule's u) come from g.
    autocast: the mixed-precision context `model`'s forward runs under (accelerator.autocast), so the blocks are
    drawn from the q the loss reads (in fp32 they were draws from another distribution than bf16's q)."""
    B, M = len(items), max(len(a) for a in anchor_lists)
    anchors = torch.tensor([a + [a[-1]] * (M - len(a)) for a in anchor_lists], device=device)  # padding repeats
    valid = torch.tensor([[m < len(a) for m in range(M)] for a in anchor_lists], device=device)  # [B, M]

    # 2. on-policy blocks: y [B, M, K]
    sampling = SamplingConfig(temperature=serve_t)  # the runtime's one sampler (argmax at 0)
    chain = []

    def sampler(logits):
        tok = sampling.sample(core.full_vocab_logits(logits.float()), g)
        chain.append(tok)
        return tok

    y = torch.zeros(B, M, k, dtype=torch.long)
    with torch.no_grad(), full_parameters(core), autocast():  # the head's inference path runs outside its forward
        for b, item in enumerate(items):
            cache = DraftCache()  # anchors ascend, so the head's context cache only grows
            for m, a in enumerate(anchor_lists[b]):
                chain.clear()
                logits = core.full_vocab_logits(core.draft_logits(
                    item["input_ids"][: a + 2].to(device), item[core.feature][: a + 1].to(device), cache, k,
                    sampler).float())
                drawn = torch.stack(chain).view(-1).cpu() if chain else torch.empty(0, dtype=torch.long)
                y[b, m] = torch.cat([drawn, sampling.sample(logits[len(chain):], g).view(-1).cpu()])
            y[b, len(anchor_lists[b]):] = y[b, len(anchor_lists[b]) - 1]
    y = y.to(device)

    # 3. the frozen target scores each sequence's context + blocks in one forward
    contexts = [it["input_ids"][: max(a) + 2].to(device) for it, a in zip(items, anchor_lists)]
    target_logits = score_blocks(scorer, contexts, anchors, y)[valid]  # [N, K, V]
    p = sampling.probs(target_logits)  # at T (one-hot at 0)
    confident = tc.confidence_weight > 0 and hasattr(core, "confidence_logit") and torch.is_grad_enabled()
    # the confidence label is alpha at T=1: at serving T=1 alpha itself, else from the target's softmax at 1
    p_one = F.softmax(target_logits.float(), -1) if confident and serve_t != 1.0 else None
    del target_logits

    # 4. the head's q on the sampled tokens (training == inference numerics)
    batch, plan = block_batch(items, contexts, anchors, valid, y)
    q_t = serve_t if serve_t > 0 else 1.0  # greedy serving: the head's own distribution (KL, REINFORCE)

    def objective(head, out):
        logits = block_logits(head, out, anchors, valid, k)  # [N, K, V]
        if not confident:
            return logits, None
        return logits, block_rows(head.confidence_logit(out.hidden, out.depth).float(), out, anchors, valid, k)

    logits, confidence = model(batch, plan, objective)
    log_q = F.log_softmax(logits / q_t, -1)
    q = log_q.exp()
    q_alpha = q if serve_t > 0 else F.softmax(logits / tc.rl_surrogate_temperature, -1)
    yv = y[valid]  # [N, K]
    alpha = acceptance_rates(p, q_alpha)  # [N, K]
    survive = None
    if confident:
        with torch.no_grad():
            survive = alpha.detach() if p_one is None else acceptance_rates(p_one, F.softmax(logits.detach(), -1))
        del p_one
    q_tok = q.gather(-1, yv[..., None]).squeeze(-1)
    p_tok = p.gather(-1, yv[..., None]).squeeze(-1)
    live = drafted(yv, eos_ids(scorer.target))
    reward = exact_accepted(p_tok.detach(), q_tok.detach(), g, live).float()  # [N]
    tokens = int(sum(c.numel() for c in contexts) + reward.numel() * (k - 1))
    terms = accepted_terms(alpha, p_tok, q_tok, live)
    return Rollout(batch, plan, anchors, valid, yv, q_t, log_q, alpha, live, confidence, survive, terms, terms.sum(1),
                   reward, tokens)


def eos_ids(target) -> Tensor:
    if "eos_ids" not in target.derived:
        target.derived["eos_ids"] = torch.tensor(eos_token_ids(target), dtype=torch.long)
    return target.derived["eos_ids"]


def acceptance_stats(r: Rollout, serve_t: float) -> dict:
    """Means over blocks: blocks, reward, expected_accepted, and alpha_1..K over the blocks that draft depth k (a
    (sum, count) pair: NaN-free when an end of turn cut every block before it)."""
    stats = {"blocks": int(r.reward.numel()), "reward": float(r.reward.mean()),
             "expected_accepted": float(r.expected.detach().mean()), "serve_temperature": serve_t}
    return stats | alpha_sums(r, "alpha_")


def alpha_sums(r: Rollout, prefix: str) -> dict:
    """{prefix + k: (sum of alpha_k, blocks that draft depth k)}."""
    kept = (r.alpha.detach() * r.live).sum(0)
    count = r.live.sum(0)
    return {f"{prefix}{d + 1}": (float(kept[d]), float(count[d])) for d in range(r.alpha.shape[1])}


def rl_step_fn(core, reference, target, dataset, tc, k: int, device, fill=None, autocast=contextlib.nullcontext):
    """The loop's step function; `core` is the head module itself (the loop passes its wrapped form as `model`).
    `fill` (online runs) adds the target's hidden states to the step's sequences."""
    scorer = compact_forward(target)

    def step_fn(model, micro: int, _schedule_temperature: float):  # RL serves at serve_t
        g = torch.Generator().manual_seed(tc.seed * BLOCK_SEED + micro)
        serve_t = tc.temperature.end if tc.rl_temperature is None else tc.rl_temperature
        items, anchor_lists = [], []
        n = len(dataset)
        for i in batch_indices(micro, tc.batch_size, n, tc.seed + 1):  # 1. anchors
            item, picked = dataset[i], []
            for _ in range(n):  # a sequence without a usable anchor: take the next one
                picked = pick_anchors(item, tc.rl_anchors, tc.rl_max_context, g)
                if picked:
                    break
                i = (i + 1) % n
                item = dataset[i]
            if not picked:
                raise _no_anchor_error(tc)
            items.append(item)
            anchor_lists.append(picked)
        if fill is not None:
            items = fill(items)
        if tc.rl_anchor_policy == "round_starts":  # where the current head's greedy chain starts its rounds
            starts = round_starts(model, target, items, k, tc.rl_max_context, device)
            anchor_lists = [pick_anchors(it, tc.rl_anchors, tc.rl_max_context, g, among=s) or uniform
                            for it, s, uniform in zip(items, starts, anchor_lists)]
        r = rollout(model, core, scorer, items, anchor_lists, tc, k, serve_t, g, device, autocast)
        N = r.reward.numel()
        loss = -r.expected.mean()
        logq_tok = r.log_q.gather(-1, r.y[..., None]).squeeze(-1)
        if serve_t > 0 and tc.rl_draw_score:  # the blocks are draws from the head: their score term (value 0)
            loss = loss - draw_score(r.terms, logq_tok).mean()
        if serve_t > 0 and tc.rl_pg_weight > 0:
            baseline = (r.reward.sum() - r.reward) / (N - 1) if N > 1 else torch.zeros_like(r.reward)
            decided = (torch.arange(k, device=device)[None] <= r.reward[:, None]) & r.live  # accepted + first rejected
            loss = loss + tc.rl_pg_weight * (-((r.reward - baseline)[:, None] * logq_tok * decided).sum(1)).mean()
        if tc.rl_kl_weight > 0:
            with torch.no_grad():
                ref_logits = block_logits(reference, reference(r.batch, r.plan), r.anchors, r.valid, k)
                ref_logp = F.log_softmax(ref_logits / r.q_t, -1)
            ref_p = ref_logp.exp()  # 0 outside a draft vocabulary, where both log-probs are -inf
            kl = torch.where(ref_p > 0, ref_p * (ref_logp - r.log_q), torch.zeros_like(ref_p)).sum(-1)  # [N, K]
            loss = loss + tc.rl_kl_weight * kl.mean()
        stats = {"tokens": r.tokens, **acceptance_stats(r, serve_t)}
        if r.confidence is not None:  # DSpark: the confidence head follows the drafts RL changes
            bce = F.binary_cross_entropy_with_logits(r.confidence, r.survive, reduction="none")
            confidence_loss = (bce * r.live).sum() / r.live.sum().clamp(min=1)
            loss = loss + tc.confidence_weight * confidence_loss
            stats["confidence_loss"] = float(confidence_loss.detach())
        return loss, stats

    return step_fn


def rl_validation_fn(head, target, holdout, tc, k: int, device, fill=None, autocast=contextlib.nullcontext):
    """validate(model=head, shard) -> {"val_expected_accepted", "val_reward", "val_alpha_1"..,
    "val_serve_temperature", "val_blocks"}: the RL objective itself on every held-out sequence (up to rl_anchors blocks
    each, sequences without a usable anchor skipped), pooled over blocks; chunks split over ranks. Anchors and draws
    come from fixed seeds apart from training's, so two calls on the same head give the same numbers. T is
    train.rl_temperature, else the schedule's end temperature."""
    scorer = compact_forward(target)
    serve_t = tc.temperature.end if tc.rl_temperature is None else tc.rl_temperature
    spans = [range(s, min(s + tc.batch_size, len(holdout))) for s in range(0, len(holdout), tc.batch_size)]
    # chunks with an anchor somewhere, chosen from the data alone: every rank runs a rollout (a collective forward
    # under DDP / FSDP) in each of its calls, none skips
    usable = [c for c, span in enumerate(spans)
              if any(pick_anchors(token_fields(holdout, i), 1, tc.rl_max_context, torch.Generator()) for i in span)]
    if not usable:
        raise _no_anchor_error(tc, "held-out ")

    @torch.no_grad()
    def validate(model=None, shard: Shard = Shard()) -> dict:
        tally = Tally()
        for j, real in shard.calls(len(usable)):
            chunk = usable[j]
            g = torch.Generator().manual_seed(tc.seed * BLOCK_SEED + HOLDOUT_SEED + chunk)
            items = [holdout[i] for i in spans[chunk]]
            if fill is not None:
                items = fill(items)
            picked = [(it, pick_anchors(it, tc.rl_anchors, tc.rl_max_context, g)) for it in items]
            picked = [(it, a) for it, a in picked if a]  # not empty: the chunk is usable
            r = rollout(head if model is None else model, head, scorer, [it for it, _ in picked],
                        [a for _, a in picked], tc, k, serve_t, g, device, autocast)
            if real:
                n = r.reward.numel()
                tally.add("val_blocks", n)
                tally.add("val_expected_accepted", float(r.expected.sum()), n)
                tally.add("val_reward", float(r.reward.sum()), n)
                tally.update(alpha_sums(r, "val_alpha_"))
        means = shard.reduce(tally)
        if not means.get("val_blocks"):
            raise _no_anchor_error(tc, "held-out ")
        return {**{key: round(v, 6) for key, v in means.items()}, "val_blocks": int(means["val_blocks"]),
                "val_serve_temperature": serve_t}

    return validate


def _no_anchor_error(tc, which: str = "") -> DraftheadsError:
    return DraftheadsError(f"no {which}sequence has a trained token within train.rl_max_context={tc.rl_max_context} "
                           "tokens; raise it")


def block_batch(items: list[dict], contexts: list[Tensor], anchors: Tensor, valid: Tensor, y: Tensor
                ) -> tuple[dict, CodPlan]:
    """The head's training inputs for blocks y [B, M, K] at anchors [B, M]: features of each context and a plan
    whose depth-d column of block m reads y_{d-1} (batch["slot_tokens"]) instead of the sequence's own x_{a+d}."""
    B, M, k = y.shape
    device = y.device
    width = max(c.numel() for c in contexts)
    batch = {"input_ids": torch.zeros(B, width, dtype=torch.long, device=device)}
    for key in ("aux_hidden", "final_hidden"):
        batch[key] = torch.zeros(B, width, items[0][key].shape[-1], device=device)
    for b, (it, c) in enumerate(zip(items, contexts)):
        batch["input_ids"][b, : c.numel()] = c
        for key in ("aux_hidden", "final_hidden"):
            batch[key][b, : c.numel()] = it[key][: c.numel()].to(device)
    plan = block_plan(anchors.cpu(), valid.cpu(), k)
    plan = CodPlan(*(t.to(device) for t in (plan.anchor, plan.depth, plan.valid, plan.trained, plan.predecessor)),
                   plan.blocks)
    fed = batch["input_ids"].gather(1, (plan.anchor + 1).clamp(max=width - 1))  # depth 1 reads x_{a+1}
    m_of = torch.searchsorted(anchors.contiguous(), plan.anchor.contiguous()).clamp(max=M - 1)
    drafted = y[torch.arange(B, device=device)[:, None], m_of, (plan.depth - 2).clamp(min=0)]
    batch["slot_tokens"] = torch.where(plan.depth > 1, drafted, fed)
    return batch, plan


def block_logits(core, out, anchors: Tensor, valid: Tensor, k: int) -> Tensor:
    """The head's full-vocabulary logits [N, K, V] per valid block from train_forward's rows."""
    return block_rows(core.full_vocab_logits(core.logits_for(out.hidden, out.depth).float()), out, anchors, valid, k)


def block_rows(values: Tensor, out, anchors: Tensor, valid: Tensor, k: int) -> Tensor:
    """values [rows, ...], one per train_forward row -> [N, K, ...] per valid block (row-major (b, m) order)."""
    M = anchors.shape[1]
    m = (anchors[out.batch_index] < out.anchor[:, None]).sum(1)  # first column of the row's anchor
    order = ((out.batch_index * M + m) * k + out.depth - 1).argsort()
    if values.shape[0] != int(valid.sum()) * k:
        raise DraftheadsError(f"RL plan gave {values.shape[0]} draft rows for {int(valid.sum())} blocks of {k}")
    return values[order].view(-1, k, *values.shape[1:])


def train_rl(cfg, head, target, dataset, holdout, out: Path, log, accelerator, stop_at_step=None, fill=None,
             settings=None):
    """Stage 2 from `head` (the stage-1 result): run_stage's (finished, state, metrics). With held-out sequences it
    logs, at step 0, every train.eval_every steps and at the end, stage 1's val_tau_est and the RL objective itself
    (rl_validation_fn)."""
    tc, k = cfg.train, head.k
    check_rl_target(target)
    if not tc.rl_steps:
        return True, ({n: v.detach().cpu() for n, v in head.state_dict().items()} if accelerator.is_main_process
                      else None), {}
    reference = frozen_copy(head, target)
    validate = None
    if holdout is not None:
        tau_est = soft_label_validation(target, tc, k, head.family_name, holdout, fill)
        on_policy = rl_validation_fn(head, target, holdout, tc, k, target.device, fill, accelerator.autocast)

        def validate(model, shard: Shard) -> dict:
            return {**tau_est(model, shard), **on_policy(model, shard)}

    stage = Stage("rl", tc.rl_steps, tc.rl_lr, min(tc.warmup_steps, tc.rl_steps // 5),
                  rl_step_fn(head, reference, target, dataset, tc, k, target.device, fill, accelerator.autocast),
                  out / "checkpoints_rl", validate,
                  keep_best=False, steps_option="train.rl_steps", settings=settings or {}, anneals=False)
    return run_stage(accelerator, head, stage, tc, log, stop_at_step)
