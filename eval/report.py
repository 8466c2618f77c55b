"""Benchmark reports: a Markdown table next to the JSON results, written the same way by every benchmark.

    python -m eval.report speedup A.json B.json ...   # one table over eval.speedup results (one row per source)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from models.errors import DraftheadsError, cli
from models.files import write_atomic


def format_cell(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, (list, tuple)):
        return " ".join(format_cell(v, 2) for v in value)
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict], columns: list[str] | None = None, digits: int = 3) -> str:
    """A GitHub Markdown table; columns default to the keys of the first row, missing cells print '-'."""
    if not rows:
        return ""
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format_cell(row.get(c), digits) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def write_report(out: str | Path, results: dict, markdown: str, title: str | None = None) -> tuple[Path, Path]:
    """Write results to `out` (JSON) and the table to the same path with a .md suffix -> (json path, md path)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = out.with_suffix(".md")
    write_atomic(md, (f"# {title}\n\n" if title else "") + markdown)
    write_atomic(out, json.dumps(results, indent=2) + "\n")  # last: a JSON on disk has its table beside it
    return out, md


SPEEDUP_COLUMNS = ["source", "plain tok/s", "speculative tok/s", "speedup", "tau", "lossless", "HF generate tok/s",
                   "HF prompt lookup tok/s"]


def speedup_rows(results: list[dict]) -> list[dict]:
    """One row per eval.speedup result: its source, the tokens/s of each mode it ran, the ratio and tau."""
    rows = []
    for r in results:
        tps = r["tokens_per_s"]
        rows.append({"source": r["source"], "plain tok/s": tps.get("plain"), "speculative tok/s": tps.get("spec"),
                     "speedup": r["speedup"], "tau": r["tau"], "lossless": r["lossless"],
                     "HF generate tok/s": tps.get("hf_generate"), "HF prompt lookup tok/s": tps.get("hf_prompt_lookup")})
    return rows


def read_speedup(path: str) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DraftheadsError(f"'{path}' is not a readable JSON file ({e}); pass the --out of eval.speedup") from None
    if result.get("bench") != "speedup":
        raise DraftheadsError(f"'{path}' is not an eval.speedup result (no \"bench\": \"speedup\"); pass its --out")
    return result


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] != "speedup":
        raise DraftheadsError("usage: python -m eval.report speedup RESULT.json [RESULT.json ...]")
    print(markdown_table(speedup_rows([read_speedup(p) for p in argv[1:]]), SPEEDUP_COLUMNS, digits=2), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
