"""How much a head's later positions can buy: held-out acceptance by depth, and the τ it implies if depth 1 were better.

    python -m eval.depth_ceiling outputs/cmp/dflash outputs/cmp/dspark [--first 0.5,0.8,1.0]

Reads each run's last held-out line in metrics.jsonl (val_acc_k: teacher-forced agreement at depth k given every
earlier token right, i.e. the chain's conditional acceptance). τ_est(a) = 1 + a * (1 + acc_2 * (1 + acc_3 * ...)) is
the greedy τ with depth 1 accepting a and the measured later depths: how far a gain at depths >= 2 (DSpark's Markov
head) can move τ on this target. The first run is the baseline of the margins. Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eval.report import markdown_table
from models.errors import DraftheadsError, cli
from train.trainer import tau_estimate


def held_out_acceptance(run: Path) -> list[float]:
    """acc_1..acc_K from the last held-out line of run/metrics.jsonl."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise DraftheadsError(f"'{path}' does not exist; pass a train.distill output directory")
    lines = []
    for line in path.read_text().splitlines():
        if '"val_acc_1"' in line:
            try:
                lines.append(json.loads(line))
            except ValueError:  # a line torn by a killed run
                continue
    if not lines:
        raise DraftheadsError(f"'{path}' has no held-out line (val_acc_1); train with train.holdout_sequences > 0")
    last = lines[-1]
    return [last[f"val_acc_{k}"] for k in range(1, 65) if f"val_acc_{k}" in last]


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="train.distill output directories; the first is the baseline")
    ap.add_argument("--first", default="0.5,0.8,1.0", help="depth-1 acceptances to evaluate τ_est at")
    args = ap.parse_args(argv)
    try:
        firsts = [float(x) for x in args.first.split(",") if x.strip()]
    except ValueError:
        raise DraftheadsError(f"--first={args.first!r} must be a comma list of numbers in [0, 1]") from None
    if not all(0 <= f <= 1 for f in firsts):
        raise DraftheadsError(f"--first={args.first!r} must be a comma list of numbers in [0, 1]")
    accs = {str(run): held_out_acceptance(run) for run in args.runs}
    base = accs[str(args.runs[0])]
    rows = []
    for name, acc in accs.items():
        row = {"run": name, "acc by depth": acc, "tau_est": round(tau_estimate(acc), 4),
               "margin": round(tau_estimate(acc) / tau_estimate(base) - 1, 4)}
        for f in firsts:
            row[f"tau_est at acc_1={f:g}"] = round(tau_estimate(acc, f), 4)
            row[f"margin at acc_1={f:g}"] = round(tau_estimate(acc, f) / tau_estimate(base, f) - 1, 4)
        rows.append(row)
    print(markdown_table(rows), end="")
    print(json.dumps({"bench": "depth_ceiling", "baseline": str(args.runs[0]), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
