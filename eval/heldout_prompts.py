"""The held-out split's first user turns as a prompts file, so a head can be judged through the runtime on the very
sequences its held-out agreement (val_acc_k) was measured on.

    python -m eval.heldout_prompts --features RUN/data/features --holdout 128 --out heldout.jsonl
    python -m eval.acceptance --prompts heldout.jsonl --source head:RUN/head ...

The held-out sequences are the last `--holdout` of the feature set (train.holdout_sequences); each one's first user
turn is cut out of its decoded tokens by the markers the tokenizer's chat template puts around a user message.
Writes Spec-Bench-style lines (question_id = sequence index, category "heldout"); prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from models.errors import DraftheadsError, cli
from models.files import write_atomic

PROBE = "\u2063probe\u2063"


def user_markers(tokenizer) -> tuple[str, str]:
    """The text the chat template writes just before a user message (its last line) and just after it (its first)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROBE}], tokenize=False)
    before, after = text.split(PROBE)
    start, end = before[before.rstrip("\n").rfind("\n") + 1:], after.split("\n")[0] or after
    if not start or not end:
        raise DraftheadsError("this tokenizer's chat template marks no start or end of a user message; "
                              "write the prompts file by hand (Spec-Bench lines: question_id, category, turns)")
    return start, end


def first_user_turn(text: str, markers: tuple[str, str]) -> str | None:
    before, after = markers
    if before not in text:
        return None
    rest = text.split(before, 1)[1]
    return rest.split(after, 1)[0] if after in rest else None


def heldout_prompts(features, tokenizer, holdout: int) -> list[dict]:
    n = len(features)
    if not 0 < holdout <= n:
        raise DraftheadsError(f"--holdout={holdout} must be in [1, {n}] (the feature set has {n} sequences)")
    markers = user_markers(tokenizer)
    rows = []
    for i in range(n - holdout, n):
        turn = first_user_turn(tokenizer.decode(features[i]["input_ids"]), markers)
        if turn is not None:
            rows.append({"question_id": i, "category": "heldout", "turns": [turn]})
    return rows


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True, help="a feature directory (RUN/data/features)")
    ap.add_argument("--holdout", type=int, required=True, help="train.holdout_sequences of the run")
    ap.add_argument("--target", default=None, help="target name (default: the one the features were built for)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from data.features import FeatureDataset
    from models.target import load_target

    if not Path(args.features, "manifest.json").is_file():
        raise DraftheadsError(f"'{args.features}' has no manifest.json; pass a feature directory (RUN/data/features)")
    features = FeatureDataset(args.features)
    name = args.target or features.manifest["fingerprint"]["name"]
    tokenizer = load_target(name, parts="head_inputs").tokenizer
    rows = heldout_prompts(features, tokenizer, args.holdout)
    write_atomic(args.out, "".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"bench": "heldout_prompts", "features": args.features, "holdout": args.holdout,
                      "prompts": len(rows), "skipped": args.holdout - len(rows), "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
