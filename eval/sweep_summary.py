"""Rank the points of a sweep from their run directories (no W&B needed) and draw its figures.

    python -m eval.sweep_summary multirun/2026-11-30_19-00-00          # a Hydra multirun (-m)
    python -m eval.sweep_summary outputs/sweeps/SWEEP_ID                 # W&B agent runs (train.distill puts them here)

A point is any directory below with a run_report.json. Its label is the settings that differ between the points
(from each resolved_config.yaml); its score the trained head's τ at the first K and temperature of its τ table.
Points without a τ table (eval.limit=0: a cheap sweep) rank after those with one, by the kept head's held-out chain
τ (`val_tau_chain` at the kept step; the column shows it for every point).
Writes sweep_summary.md and PNGs (τ per point, validation curves, acceptance per position) into the sweep directory
(or --out), prints the table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from eval.plots import plot_sweep
from eval.report import markdown_table
from models.errors import DraftheadsError, exit_on_error

NOT_LABELS = ("output_dir", "data.cache_dir", "name")


def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def collect(root: Path) -> list[dict]:
    runs = sorted(p.parent for p in root.rglob("run_report.json"))
    if not runs:
        raise DraftheadsError(f"no run_report.json below '{root}'; pass a multirun or sweep directory")
    configs = [dict(_flat(yaml.safe_load((r / "resolved_config.yaml").read_text()) or {})) for r in runs]
    varying = sorted(k for k in set().union(*configs) if k not in NOT_LABELS
                     and len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1)
    points = []
    for run, config in zip(runs, configs):
        report = json.loads((run / "run_report.json").read_text())
        head = [r for r in report.get("eval", []) if r.get("source") == "head"]
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
            if (run / "metrics.jsonl").is_file() else []
        validation = [r for r in rows if "val_loss" in r and r["stage"] == "soft_label"]
        acceptance = [float(a) for a in head[0]["acceptance"].split() if a != "-"] if head else []
        kept = next((json.loads(p.read_text()) for p in (run / "head_soft_label" / "metrics.json",
                                                         run / "head" / "metrics.json") if p.is_file()), {})
        last = validation[-1] if validation else {}
        points.append({"run": str(run), "label": ", ".join(f"{k.split('.')[-1]}={config.get(k)}" for k in varying)
                       or run.name, "settings": {k: config.get(k) for k in varying},
                       "tau": head[0]["tau"] if head else None, "k": head[0]["k"] if head else None,
                       "val_tau_est": kept.get("best_val_tau_est", last.get("val_tau_est")),
                       "val_tau_chain": kept.get("best_val_tau_chain", last.get("val_tau_chain")),
                       "best_val_loss": min((v["val_loss"] for v in validation), default=None),
                       "acceptance": acceptance, "validation": validation})
    return sorted(points, key=_rank)


def _rank(point: dict) -> tuple:
    """τ first; without a τ table, the kept head's held-out chain τ; with neither, last."""
    if point["tau"] is not None:
        return 0, -point["tau"]
    return (1, -point["val_tau_chain"]) if point["val_tau_chain"] is not None else (2, 0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", help="the sweep directory")
    ap.add_argument("--out", default=None, help="where the table and figures go (default: the sweep directory)")
    args = ap.parse_args(argv)
    root = Path(args.root)
    out = Path(args.out or root)
    points = collect(root)
    columns = ("label", "tau", "val_tau_chain", "val_tau_est", "best_val_loss")
    table = markdown_table([{"rank": i + 1, **{k: p[k] for k in columns}} for i, p in enumerate(points)])
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_summary.md").write_text(table)
    figures = plot_sweep(points, out)
    print(table)
    if not figures:
        print("(no figures: pip install matplotlib)")
    print(json.dumps({"points": [{k: p[k] for k in columns + ("settings", "run")} for p in points],
                      "figures": [str(f) for f in figures]}))


if __name__ == "__main__":
    exit_on_error(main)
