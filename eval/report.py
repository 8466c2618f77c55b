"""Benchmark reports: a Markdown table next to the JSON results, written the same way by every benchmark."""

from __future__ import annotations

import json
from pathlib import Path

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


