"""Before/after τ of two `eval.acceptance` runs on the same prompts, with a bootstrap over questions.

    python -m eval.compare_tau BEFORE.json AFTER.json [BEFORE2.json AFTER2.json ...] [--by-category]

Each pair must hold the same (question, turn) records (run with the same --prompts/--categories/--limit). τ is the
aggregate (tokens / rounds) of each run; the 95% interval resamples questions (1000 draws, seed 0) and recomputes the
τ difference, so it covers question-to-question spread and, at T > 0, the sampling noise of each run. With several
pairs (other draft seeds, or other prompts files) the same resampled questions weight every pair: one pooled
difference of aggregate τ (all after tokens / rounds minus all before), so each pair weighs by its rounds; pooled
pairs must share the sampling, max_new and target (pool runs of like τ; compare other K pair by pair). Prints one
JSON line per pair, then the pooled line last; `relative` is the difference over τ before.
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
SAME_WHEN_POOLED = ("temperature", "top_p", "top_k", "max_new", "target", "target_path")  # what τ means


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


def _setting(request: dict, key: str):
    value = request.get(key)
    return str(Path(value)) if key == "prompts" and value else value  # ./p.jsonl is p.jsonl


def check_comparable(before_path: str, after_path: str, before_results: dict, after_results: dict,
                     keys: tuple = SAME_IN_A_PAIR) -> None:
    """Two runs differ only in what is compared: the same prompts file (by content), limits, sampling, max_new, seed
    and target (`keys`). Two runs that did not record their request are not checked; one that did not, against one
    that did, is refused (nothing would say the settings agree)."""
    before, after = before_results.get("request"), after_results.get("request")
    if before is None and after is None:
        return
    if before is None or after is None:
        raise DraftheadsError(f"'{before_path if before is None else after_path}' does not record the settings it was "
                              f"run with (no 'request'), so it cannot be checked against "
                              f"'{after_path if before is None else before_path}'; rerun it with this eval.acceptance")
    diff = [f"{k}: {_setting(before, k)!r} / {_setting(after, k)!r}" for k in keys
            if _setting(before, k) != _setting(after, k)]
    if "prompts" in keys and prompts_identity(before_results) != prompts_identity(after_results):
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
    first = None
    for before_path, after_path in pairs:
        before_results, after_results = _results(before_path), _results(after_path)
        check_comparable(before_path, after_path, before_results, after_results)
        first = first or (before_path, before_results)
        check_comparable(first[0], before_path, first[1], before_results, SAME_WHEN_POOLED)  # pooled pairs
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
    tau_before, tau_after = float(b[:, 0].sum() / b[:, 1].sum()), float(a[:, 0].sum() / a[:, 1].sum())
    return {"tau_before": round(tau_before, 4), "tau_after": round(tau_after, 4), "diff": round(tau_after - tau_before, 4),
            "relative": round((tau_after - tau_before) / tau_before, 4),
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
