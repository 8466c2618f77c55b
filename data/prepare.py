"""The data stage of a run: read → (regenerate) → tokenize with the chat template → (extract features).

Every step writes to the run's data directory and is skipped or resumed when its output already exists.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from data.chat import tokenize_chat
from data.features import extract_features
from data.readers import ReadStats, read_conversations
from data.regenerate import regenerate
from models.errors import DraftheadsError
from models.target import Target


def prepare_data(target: Target, out_dir: str | Path, *, source: str = "sharegpt", path: str | None = None,
                 max_records: int = 64, skip_records: int = 0, max_length: int = 1024, overlong: str = "truncate",
                 regen: bool = True, regen_max_new: int = 128, regen_turns: int = 1, regen_batch_size: int = 8,
                 regen_temperature: float = 0.0, regen_dtype: str = "bfloat16", features: bool = True, shard_tokens: int = 16384,
                 seed: int = 0) -> dict:
    """Returns a report dict (also written to out_dir/data_report.json)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats = ReadStats()
    convs = list(itertools.islice(read_conversations(source, path, stats), skip_records, skip_records + max_records))
    if not convs:
        raise DraftheadsError(f"data source '{source}' ({path or 'packaged copy'}) gave no usable conversations "
                              f"(read stats: {stats.summary()}); check data.source / data.path")
    report: dict = {"read": stats.summary(), "conversations": len(convs)}
    if regen:
        report["regenerate"] = regenerate(
            target, convs, out / "regenerated.jsonl", max_new=regen_max_new, turns=regen_turns,
            batch_size=regen_batch_size, temperature=regen_temperature, seed=seed, dtype=regen_dtype,
            max_prompt_tokens=max(max_length - regen_max_new, 1))
        records = sorted((json.loads(l) for l in (out / "regenerated.jsonl").open(encoding="utf-8")), key=lambda r: r["id"])
        chats = [(r["conversation"], not r["finished"][-1]) for r in records]
    else:
        chats = [(c, False) for c in convs]
    sequences, overlong_count = [], 0
    for conv, open_last in chats:
        tc = tokenize_chat(target.tokenizer, conv, max_length, overlong, last_turn_open=open_last)
        if tc is None or tc.truncated:
            overlong_count += 1
        if tc is not None and tc.loss_mask.any():
            sequences.append((tc.input_ids, tc.loss_mask))
    report["tokenize"] = {"sequences": len(sequences), f"overlong_{overlong}d": overlong_count,
                          "tokens": sum(len(s[0]) for s in sequences),
                          "assistant_tokens": int(sum(int(s[1].sum()) for s in sequences))}
    if features:
        report["features"] = extract_features(target, sequences, out / "features", shard_tokens=shard_tokens)
    (out / "data_report.json").write_text(json.dumps(report, indent=1))
    return report
