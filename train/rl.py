"""Stage 2: acceptance-rate RL, on-policy, through the same loop as stage 1 (train/trainer.py run_loop).

One step, for B sequences of the feature set:
  1. pick an anchor a inside the trained (assistant) span, a + 2 <= rl_max_context (so the target re-reads the
     WHOLE context: its scores are exact, not those of a truncated prefix);
  2. sample a block y_1..y_K from the current head at temperature T (chain heads feed their samples back);
  3. the frozen target scores [x_0..x_{a+1}, y_1..y_K] in one teacher-forced forward -> p_k;
  4. recompute the head's q_k with gradients (teacher-forcing the sampled tokens: training == inference
     numerics, tests/test_peagle.py) and maximise
        E[accepted] = sum_k prod_{j<=k} alpha_j,   alpha_k = sum_v min(p_k, q_k)     (pathwise, low variance)
      + rl_pg_weight * REINFORCE on R = tokens accepted by the exact rule (min(1, p/q) then first rejection),
        baseline = mean R of the other blocks in the batch (stateless, so resume stays exact)
      - rl_kl_weight * KL(q_stage1 || q)  (anchor to the stage-1 head).
T follows the same temperature schedule as stage 1.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from inference.sampling import SamplingConfig
from models.checkpoint import FAMILIES
from models.errors import DraftheadsError
from models.peagle import DraftCache
from train.cod import CodPlan
from train.trainer import _unwrap, batch_indices, run_loop

BLOCK_SEED = 2_000_003


def frozen_copy(head, target):
    """The stage-1 reference: same class and weights, no gradients (shared target modules re-attached, not copied)."""
    ref = FAMILIES[head.family_name](**head.config)
    ref.load_state_dict(head.state_dict())
    return ref.to(device=target.device, dtype=target.dtype).attach_target(target).eval().requires_grad_(False)


def pick_anchor(item: dict, k: int, max_context: int, g: torch.Generator) -> int | None:
    """An anchor a whose next draft token (a+2) is a trained token, with a+2 <= max_context."""
    L = len(item["input_ids"])
    idx = torch.arange(L)
    ok = (idx + 2 < L) & (idx + 2 <= max_context)
    ok &= item["loss_mask"][(idx + 2).clamp(max=L - 1)]
    cand = ok.nonzero().squeeze(1)
    if cand.numel() == 0:
        return None
    return int(cand[torch.randint(cand.numel(), (1,), generator=g)])


def block_plan(anchors: list[int], k: int, device) -> CodPlan:
    """Plan with depth-1 tokens for anchors 0..a_b (the context) and depths 1..K trained for anchor a_b only."""
    B, W = len(anchors), max(anchors) + 1
    a1 = torch.arange(W).expand(B, W).clone()
    v1 = a1 <= torch.tensor(anchors)[:, None]
    tr1 = a1 == torch.tensor(anchors)[:, None]
    cols_a, cols_d, cols_v, cols_t, cols_p = [a1], [torch.ones(B, W, dtype=torch.long)], [v1], [tr1], [torch.full((B, W), -1)]
    blocks = [0, W]
    for d in range(2, k + 1):
        cols_a.append(torch.tensor(anchors)[:, None])
        cols_d.append(torch.full((B, 1), d))
        cols_v.append(torch.ones(B, 1, dtype=torch.bool))
        cols_t.append(torch.ones(B, 1, dtype=torch.bool))
        cols_p.append(torch.tensor(anchors)[:, None] if d == 2 else torch.full((B, 1), blocks[-2]))
        blocks.append(blocks[-1] + 1)
    cat = lambda xs: torch.cat(xs, 1).to(device)  # noqa: E731
    return CodPlan(cat(cols_a), cat(cols_d), cat(cols_v), cat(cols_t), cat(cols_p), blocks)


def exact_accepted(p_tok: Tensor, q_tok: Tensor, g: torch.Generator) -> Tensor:
    """R [B]: tokens accepted by the lossless rule (accept y_k w.p. min(1, p/q); stop at the first rejection)."""
    u = torch.rand(p_tok.shape, generator=g).to(p_tok.device)
    ok = u < (p_tok / q_tok.clamp(min=1e-20)).clamp(max=1.0)
    return ok.long().cumprod(1).sum(1)


def expected_accepted(alpha: Tensor) -> Tensor:
    """[B]: sum_k prod_{j<=k} alpha_j for alpha [B, K]."""
    return alpha.cumprod(1).sum(1)


def rl_step_fn(head, reference, target, dataset, tc, k: int, device):
    def step_fn(micro: int, temperature: float):
        core = _unwrap(head)
        g = torch.Generator().manual_seed(tc.seed * BLOCK_SEED + micro)
        items, anchors = [], []
        n = len(dataset)
        for i in batch_indices(micro, tc.batch_size, n, tc.seed + 1):
            item, a = dataset[i], None
            for _ in range(n):  # a sequence without a usable anchor: take the next one
                a = pick_anchor(item, k, tc.rl_max_context, g)
                if a is not None:
                    break
                i = (i + 1) % n
                item = dataset[i]
            if a is None:
                raise DraftheadsError(f"no sequence has a trained token within train.rl_max_context="
                                      f"{tc.rl_max_context} tokens; raise it")
            items.append(item)
            anchors.append(a)

        # 1-2. on-policy blocks (no grad): y [B, K]
        sampling = SamplingConfig(temperature=temperature)  # the runtime's one sampler

        def sampler(logits):
            tok = sampling.sample(core.full_vocab_logits(logits.float()), g)
            blocks[-1].append(tok)
            return tok

        blocks = []
        for item, a in zip(items, anchors):
            blocks.append([])
            feats = item[core.feature][: a + 1].to(device)
            logits = core.full_vocab_logits(core.draft_logits(item["input_ids"][: a + 2].to(device), feats, DraftCache(),
                                                              k, sampler).float())
            rest = sampling.sample(logits[len(blocks[-1]):], g)
            blocks[-1] = torch.cat([torch.stack(blocks[-1]).view(-1), rest]) if blocks[-1] else rest
        y = torch.stack(blocks).to(device)  # [B, K]

        # 3. the frozen target scores context + block in one forward
        seqs = [torch.cat([it["input_ids"][: a + 2].to(device), y[b]]) for b, (it, a) in enumerate(zip(items, anchors))]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        attn = torch.zeros_like(ids)
        for b, s in enumerate(seqs):
            ids[b, : len(s)], attn[b, : len(s)] = s, 1
        with torch.no_grad():
            rows = torch.tensor(anchors, device=device)[:, None] + 1 + torch.arange(k, device=device)  # [B, K]
            final = target(ids, attention_mask=attn, compute_logits=False).final_hidden
            p_logits = target.lm_head(final.gather(1, rows[..., None].expand(-1, -1, final.shape[-1])))  # [B, K, V]
            p = F.softmax(p_logits.float() / temperature, -1)

        # 4. the head's q with gradients, on the sampled tokens
        H = items[0]["aux_hidden"].shape[-1]
        batch = {"input_ids": ids, "aux_hidden": torch.zeros(len(items), width, H, device=device),
                 "final_hidden": torch.zeros(len(items), width, items[0]["final_hidden"].shape[-1], device=device)}
        for b, (it, a) in enumerate(zip(items, anchors)):
            batch["aux_hidden"][b, : a + 1] = it["aux_hidden"][: a + 1].to(device)
            batch["final_hidden"][b, : a + 1] = it["final_hidden"][: a + 1].to(device)
        plan = block_plan(anchors, k, device)
        out = head(batch, plan)  # through the (possibly distributed) wrapper
        q_logits = core.full_vocab_logits(core.logits_for(out.hidden, out.depth).float()).view(len(items), k, -1)
        log_q = F.log_softmax(q_logits / temperature, -1)
        q = log_q.exp()
        alpha = torch.minimum(p, q).sum(-1)  # [B, K]
        expected = expected_accepted(alpha)
        q_tok = q.gather(-1, y[..., None]).squeeze(-1)
        p_tok = p.gather(-1, y[..., None]).squeeze(-1)
        reward = exact_accepted(p_tok.detach(), q_tok.detach(), g).float()  # [B]
        B = len(items)
        baseline = (reward.sum() - reward) / (B - 1) if B > 1 else torch.zeros_like(reward)
        decided = torch.arange(k, device=device)[None] <= reward[:, None]  # accepted tokens + the first rejected
        logq_tok = log_q.gather(-1, y[..., None]).squeeze(-1)
        pg = -((reward - baseline)[:, None] * logq_tok * decided).sum(1)
        loss = -expected.mean() + tc.rl_pg_weight * pg.mean()
        if tc.rl_kl_weight > 0:
            with torch.no_grad():
                ref_out = reference(batch, plan)
                ref_logits = reference.full_vocab_logits(reference.logits_for(ref_out.hidden, ref_out.depth).float())
                ref_logp = F.log_softmax(ref_logits.view(B, k, -1) / temperature, -1)
            ref_p = ref_logp.exp()  # 0 outside a draft vocabulary, where both log-probs are -inf
            kl = torch.where(ref_p > 0, ref_p * (ref_logp - log_q), torch.zeros_like(ref_p)).sum(-1)  # [B, K]
            loss = loss + tc.rl_kl_weight * kl.mean()
        stats = {"tokens": int(sum(len(s) for s in seqs)), "reward": float(reward.mean()),
                 "expected_accepted": float(expected.detach().mean())}
        for d in range(k):
            stats[f"alpha_{d + 1}"] = float(alpha[:, d].detach().mean())
        return loss, stats

    return step_fn


def train_rl(cfg, head, target, dataset, out: Path, metrics_path: Path, wandb_run=None, stop_at_step=None):
    """Stage 2 from `head` (the stage-1 result); returns (head, last metrics), or (None, ...) on a simulated kill."""
    tc = cfg.train
    if not cfg.train.rl_steps:
        return head, {}
    reference = frozen_copy(_unwrap(head), target)
    step_fn = rl_step_fn(head, reference, target, dataset, tc, _unwrap(head).k, target.device)
    metrics = run_loop(head, step_fn, steps=tc.rl_steps, lr=tc.rl_lr, warmup=min(tc.warmup_steps, tc.rl_steps // 5),
                       weight_decay=tc.weight_decay, max_grad_norm=tc.max_grad_norm, grad_accum=tc.grad_accum,
                       mixed_precision=tc.mixed_precision, ckpt_root=out / "checkpoints_rl",
                       checkpoint_every=tc.checkpoint_every, log_every=tc.log_every, metrics_path=metrics_path,
                       stage="rl", temperature_cfg=tc.temperature, resume=tc.resume, cpu=target.device.type == "cpu",
                       wandb_run=wandb_run, stop_at_step=stop_at_step)
    if stop_at_step is not None and stop_at_step < tc.rl_steps:
        return None, metrics
    return head, metrics
