"""Sequential Temperature Scaling (STS) of a DSpark confidence head on held-out feature sequences.

The head's c_k = sigmoid(z_k / tau_k) should be P(draft k survives | drafts < k accepted), so the product
S_k = prod_{j<=k} c_j should be P(drafts 1..k all accepted) — what the confidence prefix scheduler multiplies.
STS fits tau_1, tau_2, ... LEFT TO RIGHT: with tau_<k fixed, tau_k is the grid value minimising the ECE of S_k
against the empirical outcome "1..k all accepted". Outcomes come from teacher-forced blocks at random anchors
of held-out sequences (every block fully inside the trained span): accepted_k = sum_v min(p_k, q_k) under the
runtime's SamplingConfig at `temperature` — 0/1 (draft argmax == target argmax) when greedy, the exact acceptance
probability of the lossless rule when T > 0. At T = 0 teacher forcing is exact: while 1..k-1 are accepted the
drafted prefix is the true one (regenerated data = the target's own greedy output). At T > 0 it is an approximation:
an accepted prefix is then the draft's sampled tokens, not the greedy ones, so the outcomes are those of the greedy
path (likely the easiest) and the fitted S_k may run high; the cost is speed (the prefix scheduler keeps too many
drafts), never output.

    python -m train.calibration --head DIR --features DIR [--temperature 0] [--out DIR]   (one JSON line last)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor

from inference.sampling import SamplingConfig
from inference.verify import acceptance_rates
from train.cod import anchor_plan
from models.errors import DraftheadsError, exit_on_error

BINS = 15
GRID = torch.logspace(-1.3, 1.3, 81)  # tau from 0.05 to 20; index 40 is exactly 1


def ece(pred: Tensor, outcome: Tensor, bins: int = BINS) -> float:
    """Expected calibration error [0, 1]: equal-width bins of pred, |mean pred - mean outcome| weighted by size."""
    which = (pred.clamp(0, 1) * bins).long().clamp(max=bins - 1)
    total = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += float(sel.sum()) * abs(float(pred[sel].mean() - outcome[sel].mean()))
    return total / max(pred.numel(), 1)


def fit_sequential_temperature(z: Tensor, accepted: Tensor) -> tuple[Tensor, dict]:
    """z [M, K] raw confidence logits, accepted [M, K] in [0, 1] -> (tau [K], {"ece_before": [K], "ece_after": [K]})."""
    survive = accepted.float().cumprod(1)  # "1..k all accepted"
    K = z.shape[1]
    tau = torch.ones(K)
    before = [ece(torch.sigmoid(z[:, : k + 1]).prod(1), survive[:, k]) for k in range(K)]
    after, prefix = [], torch.ones(z.shape[0])
    for k in range(K):
        scores = [ece(prefix * torch.sigmoid(z[:, k] / t), survive[:, k]) for t in GRID]
        best = min(range(len(GRID)), key=scores.__getitem__)
        tau[k] = GRID[best]
        prefix = prefix * torch.sigmoid(z[:, k] / tau[k])
        after.append(scores[best])
    return tau, {"ece_before": [round(x, 5) for x in before], "ece_after": [round(x, 5) for x in after]}


@torch.no_grad()
def confidence_data(head, target, features, temperature: float = 0.0, anchors: int = 32, seed: int = 0,
                    limit: int | None = None) -> tuple[Tensor, Tensor]:
    """Raw confidence logits z [M, K] and acceptance outcomes [M, K] of teacher-forced blocks."""
    from train.trainer import collate

    sampling = SamplingConfig(temperature=temperature)
    g = torch.Generator().manual_seed(seed)
    K, zs, accs = head.k, [], []
    n = len(features) if limit is None else min(limit, len(features))
    for i in range(n):
        batch = collate([features[i]], target.device)
        plan = anchor_plan(batch["loss_mask"].cpu(), batch["lengths"].cpu(), K, anchors, g, full_blocks=True)
        if not (plan.valid & plan.trained).any():
            continue
        plan = type(plan)(**{f: (v.to(target.device) if isinstance(v, Tensor) else v) for f, v in vars(plan).items()})
        out = head(batch, plan)  # rows: block after block, depths 1..K
        rows = out.anchor + out.depth  # target row a+k scores draft token k
        p = sampling.probs(target.lm_head(batch["final_hidden"][out.batch_index, rows].to(target.dtype)))
        q = sampling.probs(head.full_vocab_logits(head.logits_for(out.hidden, out.depth).float()))
        accs.append(acceptance_rates(p, q).view(-1, K).cpu())
        zs.append(head.confidence(out.hidden).squeeze(-1).float().view(-1, K).cpu())
    if not zs:
        raise DraftheadsError(f"no held-out sequence has a trained span of {K + 1}+ tokens to calibrate on; "
                              "pass longer or more feature sequences")
    return torch.cat(zs), torch.cat(accs)


def calibrate(head, target, features, temperature: float = 0.0, anchors: int = 32, seed: int = 0,
              limit: int | None = None) -> dict:
    """Fit the head's per-position confidence temperatures in place; returns the ECE report."""
    if not hasattr(head, "confidence_temperature"):
        raise DraftheadsError(f"draft family '{head.family_name}' has no confidence head to calibrate; "
                              "calibration is for dspark / dflash heads")
    z, accepted = confidence_data(head, target, features, temperature, anchors, seed, limit)
    tau, report = fit_sequential_temperature(z, accepted)
    head.confidence_temperature.copy_(tau.to(head.confidence_temperature))
    return {"blocks": int(z.shape[0]), "temperature": temperature, "tau": [round(float(t), 4) for t in tau],
            "acceptance": [round(float(a), 4) for a in accepted.mean(0)], **report}


def held_out_count(head_dir) -> int:
    """train.holdout_sequences of the run that made the head (its resolved_config.yaml): the sequences at the end of
    its features it never trained on. None recorded is an error: fitting on trained sequences inflates acceptance,
    so the confidences would run high and the prefix cut keep too many drafts."""
    from omegaconf import OmegaConf

    path = Path(head_dir) / "resolved_config.yaml"
    n = OmegaConf.select(OmegaConf.load(path), "train.holdout_sequences", default=0) if path.is_file() else 0
    if not n:
        raise DraftheadsError(f"the head in '{head_dir}' records no held-out sequences (train.holdout_sequences): "
                              "calibrating on sequences it trained on makes its confidences run high. Pass --holdout N "
                              "for the last N sequences of --features it never trained on, or --holdout 0 with "
                              "features of other text")
    return int(n)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m train.calibration", description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="a dspark / dflash checkpoint directory (out_dir/head)")
    ap.add_argument("--features", required=True, help="held-out feature directory (data/features layout)")
    ap.add_argument("--out", default=None, help="where to write the calibrated head (default: back into --head)")
    ap.add_argument("--target-path", default=None, help="target weights (default: the name recorded in the head)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy acceptance; > 0 = lossless rule at T")
    ap.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    ap.add_argument("--holdout", type=int, default=None,
                    help="use only the last N sequences of --features (default: the head's train.holdout_sequences, "
                         "the split it never trained on); 0: all of --features, for features it never trained on")
    ap.add_argument("--limit", type=int, default=None, help="sequences to use (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from data.features import require_hidden
    from models.checkpoint import load_draft, read_metrics, save_draft, target_for_head
    from train.trainer import open_features, split_holdout

    target = target_for_head(args.head, args.target_path)
    head = load_draft(args.head, target)
    features = open_features(args.features, target)
    require_hidden(features, args.features, "calibration")
    holdout = held_out_count(args.head) if args.holdout is None else args.holdout
    if holdout:
        features = split_holdout(features, holdout)[1]
    report = calibrate(head, target, features, args.temperature, args.anchors, limit=args.limit)
    src = Path(args.head)
    metrics = read_metrics(src)
    resolved = (src / "resolved_config.yaml").read_text() if (src / "resolved_config.yaml").is_file() else None
    out = save_draft(head, args.out or src, target, resolved, {**metrics, "calibration": report})
    report["out"] = str(out)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    exit_on_error(main)
