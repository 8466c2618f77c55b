"""Where a greedy chain's rounds start: a head's teacher-forced agreement at every (position, depth) of a run's
held-out sequences, and the chain simulated on it.

    python -m eval.chain_simulation RUN [--holdout 128] [--limit 64] [--k 5] [--max-new 64]

The walk is train.chain's (the trainer's val_tau_chain at K = draft.k over whole answers is the same simulation).
Agreement by depth is reported three ways: over every position (what val_acc_k averages), over every position given
the earlier depths agreed (the chain's conditional), and over the positions where the simulated rounds start (what
eval.acceptance counts). A gap between the last two is a selection effect: rounds start right after a rejection.
Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from eval.report import markdown_table
from models.errors import DraftheadsError, cli
from train.chain import agreement, simulate_chain
from train.trainer import collate, tau_estimate


def by_depth(starts: torch.Tensor, k: int) -> dict:
    """starts [N, k] hits of N rounds: unconditional agreement and acceptance given every earlier depth agreed."""
    uncond, cond = [], []
    alive = torch.ones(starts.shape[0], dtype=torch.bool)
    for d in range(k):
        uncond.append(round(float(starts[:, d].float().mean()), 4))
        cond.append(round(float(starts[alive, d].float().mean()), 4) if alive.any() else 0.0)
        alive &= starts[:, d]
    return {"agreement": uncond, "acceptance": cond, "tau_est": round(tau_estimate(cond), 4)}


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a train.distill output directory (its head/ and data/features)")
    ap.add_argument("--holdout", type=int, default=None, help="held-out sequences (default: the run's "
                    "train.holdout_sequences from resolved_config.yaml)")
    ap.add_argument("--limit", type=int, default=64, help="the first N held-out sequences")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=64, help="tokens per answer, as eval.acceptance --max-new")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from data.features import FeatureDataset, require_hidden
    from models.checkpoint import load_draft
    from models.target import load_target

    features_dir, head_dir = args.run / "data" / "features", args.run / "head"
    for path in (features_dir / "manifest.json", head_dir / "config.json"):
        if not path.is_file():
            raise DraftheadsError(f"'{path}' does not exist; pass a finished train.distill output directory")
    holdout = args.holdout
    if holdout is None:
        from omegaconf import OmegaConf

        holdout = int(OmegaConf.load(args.run / "resolved_config.yaml").train.holdout_sequences)
    torch.set_num_threads(args.threads)
    features = FeatureDataset(features_dir)
    require_hidden(features, features_dir, "the chain simulation")
    if not 0 < holdout <= len(features):
        raise DraftheadsError(f"--holdout={holdout} must be in [1, {len(features)}] (a run with "
                              "train.holdout_sequences=0 held nothing out: pass --holdout N for its last N sequences)")
    target = load_target(features.manifest["fingerprint"]["name"], parts="head_inputs")
    head = load_draft(head_dir, target)
    if args.k > head.k:
        raise DraftheadsError(f"--k={args.k} exceeds the head's {head.k} draft positions; pass --k <= {head.k}")
    first = len(features) - holdout
    every, starts, rounds = [], [], []
    for i in range(first, min(first + args.limit, len(features))):
        item = features[i]
        hit = agreement(head, target, collate([item], target.device), args.k)[0]
        answer = item["loss_mask"].bool()
        labelled = answer.nonzero().flatten()
        anchors = labelled[(labelled >= 2) & (labelled + args.k - 1 < len(answer))] - 2  # depth 1 drafts an answer token
        every.append(hit[anchors])
        walked = simulate_chain(hit, answer, args.max_new)
        starts += [hit[t] for t, _ in walked]
        rounds += [a for _, a in walked]
    if not rounds:
        raise DraftheadsError(f"the held-out sequences of '{args.run}' have no answer tokens to simulate")
    table = {"every position": by_depth(torch.cat(every), args.k),
             "round starts (simulated chain)": by_depth(torch.stack(starts), args.k)}
    rows = [{"positions": name, "n": n, **{f"agree_{d + 1}": v["agreement"][d] for d in range(args.k)},
             **{f"accept_{d + 1}": v["acceptance"][d] for d in range(args.k)}, "tau_est": v["tau_est"]}
            for (name, v), n in zip(table.items(), (sum(len(e) for e in every), len(starts)))]
    tau = 1 + sum(rounds) / len(rounds)
    print(markdown_table(rows), end="")
    print(f"simulated chain: {len(rounds)} rounds, τ {tau:.3f}")
    print(json.dumps({"bench": "chain_simulation", "run": str(args.run), "sequences": len(every), "k": args.k,
                      "max_new": args.max_new, "rounds": len(rounds), "tau": round(tau, 4), "positions": table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
