"""The greedy chain a head would run on held-out sequences, simulated from teacher-forced agreement: the trainer's
val_tau_chain and eval.chain_simulation.

Held-out sequences are the target's own greedy answers (regenerated at T=0), so greedy speculative decoding of their
prompts walks exactly these tokens: a round at anchor t (tokens up to t+1 known, target features up to t) accepts
the longest run of drafts that agree with the target's greedy token, emits one more, and the next round's anchor is
t + accepted + 1. Rounds start right after a rejection, where a head is weaker than on average, so the chain's τ is
lower than val_tau_est (which multiplies agreement averaged over every position): by 0.12-0.17 on the million-token
P-EAGLE head, whose simulated chain matched the runtime's τ to 0.003 (README).
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.sampling import greedy_tokens
from models.families import family
from train.cod import CodPlan, anchor_plan, cod_plan, plan_to
from train.distributed import calls_everywhere
from train.trainer import LOSS_CHUNK_ROWS, target_greedy


def full_plan(loss_mask: Tensor, lengths: Tensor, k: int, blocks: bool) -> CodPlan:
    """Every anchor at every depth: whole blocks for block drafters, COD columns with nothing dropped otherwise."""
    if blocks:
        return anchor_plan(loss_mask, lengths, k, anchors=loss_mask.shape[1])
    return cod_plan(loss_mask, lengths, k, 1.0)


def agreement(model, target, batch: dict, k: int) -> Tensor:
    """hit [B, T, k] bool: the head's depth-d draft at anchor t equals the target's greedy token t+d+1 (teacher-forced,
    every anchor and depth; False where the label lies outside the answer). `model` may be a sharding wrapper."""
    core = getattr(model, "module", model)
    device = batch["input_ids"].device
    plan = plan_to(full_plan(batch["loss_mask"].cpu(), batch["lengths"].cpu(), k, family(core.family_name).blocks),
                   device)

    def hits(head, rows):
        agree = torch.zeros(rows.hidden.shape[0], dtype=torch.bool, device=device)
        chunks = calls_everywhere(-(-rows.hidden.shape[0] // LOSS_CHUNK_ROWS), head, device)  # ZeRO-3: on all ranks
        for c in range(chunks):
            chunk = slice(c * LOSS_CHUNK_ROWS, (c + 1) * LOSS_CHUNK_ROWS)
            best = target_greedy(target, head, batch, rows, chunk)  # no target logits when the features carry it
            agree[chunk] = greedy_tokens(head.logits_for(rows.hidden[chunk], rows.depth[chunk])) == best
        return rows, agree

    with torch.no_grad():
        rows, agree = model(batch, plan, hits)
    hit = torch.zeros(*batch["input_ids"].shape, k, dtype=torch.bool)
    hit[rows.batch_index.cpu(), rows.anchor.cpu(), rows.depth.cpu() - 1] = agree.cpu()
    return hit


def simulate_chain(hit: Tensor, loss_mask: Tensor, max_new: int | None = None) -> list[tuple[int, int]]:
    """(anchor, accepted drafts) per round of greedy decoding that follows each answer (a contiguous run of the loss
    mask: one assistant turn, decoded by its own request) from its first token, as the runtime decodes: the prompt's
    last token is the first round's input, so that round drafts the first answer token from anchor first - 2; a
    round emits its accepted drafts and one more token but never past the answer's last token (the end of turn, or
    where regeneration stopped) nor past max_new per answer (None: the whole answer), and drafts only as many tokens
    as leave room for that one more (the runtime's k = min(K, max_new - emitted - 1)). User turns between answers
    are prompt, not rounds."""
    hit = hit.tolist()  # Python bools: the walk reads them one by one
    rounds = []
    for first, last in answer_spans(loss_mask):
        rounds += _walk(hit, first, last, max_new)
    return rounds


def answer_spans(loss_mask: Tensor) -> list[tuple[int, int]]:
    """(first, last) index of every contiguous run of True in loss_mask [T]."""
    m = loss_mask.bool().tolist()
    starts = [i for i, v in enumerate(m) if v and (i == 0 or not m[i - 1])]
    ends = [i for i, v in enumerate(m) if v and (i + 1 == len(m) or not m[i + 1])]
    return list(zip(starts, ends))


def _walk(hit: list, first: int, end: int, max_new: int | None) -> list[tuple[int, int]]:
    t, emitted, rounds = max(first - 2, 0), 0, []  # tokens up to t + 1 known
    while t < end - 1 and (max_new is None or emitted < max_new):
        room = end - t - 1 if max_new is None else min(end - t - 1, max_new - emitted)  # tokens this round may emit
        accepted = 0
        while accepted < min(len(hit[t]), room - 1) and hit[t][accepted]:
            accepted += 1
        rounds.append((t, accepted))
        emitted += accepted + 1
        t += accepted + 1
    return rounds


def round_start_mask(model, target, batch: dict, k: int) -> Tensor:
    """bool [B, T]: the anchors where the greedy chain the head would run now starts its rounds over each sequence of
    the batch. A round starts right after a rejection, so these are the positions greedy serving drafts from, harder
    than the average one (train.rl_anchor_policy=round_starts, train.round_start_weight)."""
    hit = agreement(model, target, batch, k)
    mask = torch.zeros(hit.shape[:2], dtype=torch.bool)
    for b in range(hit.shape[0]):
        mask[b, [t for t, _ in simulate_chain(hit[b], batch["loss_mask"][b].cpu().bool())]] = True
    return mask


def round_start_weights(target, k: int, extra: float):
    """weights(model, batch) -> [B, T] on the batch's device: 1 + extra at the round starts of the head's greedy chain
    (recomputed for every batch, so it follows the head as it trains), 1 elsewhere (train.round_start_weight)."""

    def weights(model, batch: dict) -> Tensor:
        return (1.0 + extra * round_start_mask(model, target, batch, k).float()).to(batch["input_ids"].device)

    return weights


def chain_fn(target, k: int):
    """chain(model, batch) -> (tokens emitted, rounds) of the simulated greedy chain at K = k over a batch of held-out
    sequences (train.trainer.prepare_batch)."""

    def chain(model, batch: dict) -> tuple[int, int]:
        hit = agreement(model, target, batch, k)
        emitted = rounds = 0
        for b in range(hit.shape[0]):
            walked = simulate_chain(hit[b], batch["loss_mask"][b].cpu().bool())
            emitted += sum(a + 1 for _, a in walked)
            rounds += len(walked)
        return emitted, rounds

    return chain
