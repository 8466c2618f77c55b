"""Before/after τ of two `eval.acceptance` runs on the same prompts, with a bootstrap over questions.

    python -m eval.compare_tau BEFORE.json AFTER.json [BEFORE2.json AFTER2.json ...] [--by-category]

Each pair must hold the same (question, turn) records (run with the same --prompts/--categories/--limit). τ is the
aggregate (tokens / rounds) of each run; the 95% interval resamples questions (1000 draws, seed 0) and recomputes the
τ difference, so it covers question-to-question spread and, at T > 0, the sampling noise of each run. With several
pairs (other seeds or K) the same resampled questions weight every pair: one pooled difference. Prints one JSON
line per pair, then the pooled line last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from models.errors import DraftheadsError, cli


# what a pair's two runs must share (the draft source, K, dtype and engine may differ: they are what is compared)
SAME_IN_A_PAIR = ("prompts", "categories", "limit", "skip", "temperature", "top_p", "top_k", "max_new", "seed", "target",
                  "target_path")


def _results(path: str) -> dict:
    try:
        results = json.load(open(path))
        results["turns"]  # noqa: B018 (the key every reader needs)
        return results
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DraftheadsError(f"'{path}' is not an eval.acceptance results JSON ({e}); pass the --out file of a run") from None


def turn_counts(results: dict, category: str | None = None, what: str = "the results") -> dict[tuple, tuple[int, int]]:
    """(question_id, turn) -> (tokens, rounds) of one acceptance run's results (of one category's questions)."""
    counts = {}
    for r in results["turns"]:
        key = (r["question_id"], r["turn"])
        if key in counts:
            raise DraftheadsError(f"{what} hold question_id {key[0]!r} (turn {key[1]}) twice: its prompts file repeats "
                                  "an id, so questions cannot be paired; give every prompt a unique question_id")
        if category is None or r["category"] == category:
            counts[key] = (r["tokens"], r["rounds"])
    return counts


def prompts_identity(results: dict) -> str:
    """The sha256 of the prompts file a run read ('' for a run that did not record it)."""
    request = results.get("request", {})
    prompts = request.get("prompts")
    return request.get("files", {}).get(str(Path(prompts)) if prompts else None, "")  # keyed as eval.acceptance wrote


def check_comparable(before_path: str, after_path: str, before_results: dict, after_results: dict) -> None:
    """Two runs differ only in what is compared: the same prompts file (by content), limits, sampling, max_new, seed
    and target. Runs that did not record their request are not checked."""
    before, after = before_results.get("request"), after_results.get("request")
    if before is None or after is None:
        return
    diff = [f"{k}: {before.get(k)!r} / {after.get(k)!r}" for k in SAME_IN_A_PAIR if before.get(k) != after.get(k)]
    if prompts_identity(before_results) != prompts_identity(after_results):
        diff.append("the prompts file's content")
    if diff:
        raise DraftheadsError(f"'{before_path}' and '{after_path}' were run with other settings ({'; '.join(diff)}): "
                              "their τ difference would measure those; rerun one with the other's settings")


def categories_of(path: str) -> list[str]:
    """The categories of one acceptance JSON, in the order its turns come."""
    return list(dict.fromkeys(r["category"] for r in _results(path)["turns"]))


def tau_difference(pairs: list[tuple[str, str]], draws: int = 1000, seed: int = 0, category: str | None = None) -> dict:
    rows_b, rows_a, question = [], [], []
    qids: dict = {}
    for before_path, after_path in pairs:
        before_results, after_results = _results(before_path), _results(after_path)
        check_comparable(before_path, after_path, before_results, after_results)
        before = turn_counts(before_results, category, f"'{before_path}'")
        after = turn_counts(after_results, category, f"'{after_path}'")
        if set(before) != set(after):
            raise DraftheadsError(f"'{before_path}' and '{after_path}' cover different prompts/turns; rerun both with "
                                  "the same --prompts, --categories and --limit")
        prompts = prompts_identity(before_results)  # pooled pairs share a question only within one prompts file
        for key in sorted(before, key=str):
            rows_b.append(before[key])
            rows_a.append(after[key])
            question.append(qids.setdefault((prompts, key[0]), len(qids)))
    b, a = torch.tensor(rows_b, dtype=torch.float64), torch.tensor(rows_a, dtype=torch.float64)  # [N, (tokens, rounds)]
    q = torch.tensor(question)

    def diff(w: torch.Tensor) -> float:
        return float((a[:, 0] * w).sum() / (a[:, 1] * w).sum() - (b[:, 0] * w).sum() / (b[:, 1] * w).sum())

    g = torch.Generator().manual_seed(seed)
    boot = torch.tensor([diff(torch.bincount(torch.randint(len(qids), (len(qids),), generator=g),
                                             minlength=len(qids)).double()[q]) for _ in range(draws)])
    ones = torch.ones(len(q), dtype=torch.float64)
    return {"tau_before": round(float(b[:, 0].sum() / b[:, 1].sum()), 4),
            "tau_after": round(float(a[:, 0].sum() / a[:, 1].sum()), 4), "diff": round(diff(ones), 4),
            "ci95": [round(float(boot.quantile(0.025)), 4), round(float(boot.quantile(0.975)), 4)],
            "questions": len(qids), "turns": len(q), "pairs": len(pairs)}


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.compare_tau", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="BEFORE.json AFTER.json, repeated")
    ap.add_argument("--by-category", action="store_true", help="also one line per category of the prompts")
    args = ap.parse_args(argv)
    if len(args.runs) % 2:
        raise DraftheadsError("give results JSONs in BEFORE AFTER pairs")
    pairs = list(zip(args.runs[::2], args.runs[1::2]))
    for pair in pairs if len(pairs) > 1 else []:
        print(json.dumps({"before": pair[0], "after": pair[1], **tau_difference([pair])}))
    for category in categories_of(pairs[0][0]) if args.by_category else []:
        print(json.dumps({"category": category, **tau_difference(pairs, category=category)}))
    print(json.dumps({"bench": "compare_tau", **tau_difference(pairs)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
