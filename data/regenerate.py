"""Regeneration: assistant turns re-written by the target, so the draft imitates the deployed model.

Decoding runs on the project's own runtime (inference/runtime.py: static KV cache, right-padded batches, plain
decoding, Llama-style targets) in `dtype`, bfloat16 by default (eval/regen_bench.py measures it against HF
`generate`), or on an OpenAI-compatible serving engine (data.regen_backend=openai: vLLM / SGLang, tensor-parallel
for large targets). The text is what the target deployed in that dtype writes; greedy bf16 and fp32 continuations can
part after a few dozen tokens.

Batched (prompts sorted by length to cut padding), seeded per batch, appended to JSONL as each batch finishes and
resumed by skipping records already on disk: a torn last line is cut off (the file is truncated, never rewritten),
a batch only partly on disk is generated again whole (batch composition shapes the numerics) and only its missing
records are appended, so a kill at any byte loses and duplicates nothing and the resumed file holds the records of
an uninterrupted run. Split over W ranks, rank r generates batches r, r + W, ... into its own part file; the main
process merges the parts in batch order (merge_parts), which is exactly the single-process file.
Each part's generation time and new tokens over every run that wrote it (resumes included) accumulate in a progress
file beside it (PART.progress.json, replaced atomically after each batch): the report's "all_runs".
"""

from __future__ import annotations

import copy
import glob
import json
import os
import re
import time
from pathlib import Path

import torch
from tqdm import tqdm

from data.chat import prompt_ids
from data.readers import Conversation
from inference.runtime import Runtime
from inference.sampling import SamplingConfig
from models.errors import DraftheadsError
from models.files import write_atomic
from models.target import Target, _parse_dtype

PROGRESS = ".progress.json"  # PART.progress.json: a part file's generation counts over every run


def _user_turns(conv: Conversation, turns: int) -> tuple[list[dict], list[str]]:
    system = [t for t in conv[:1] if t["role"] == "system"]
    users = [t["content"] for t in conv if t["role"] == "user"][:turns]
    return system, users


def _read_done(path: Path, truncate: bool = True) -> dict[int, dict]:
    """Finished records by id. A half-written last line (a kill mid-write) is cut off by truncating the file, or
    (truncate=False: a file another process may be writing) left out."""
    done: dict[int, dict] = {}
    if not path.exists():
        return done
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # complete lines end with \n; what follows the last one is torn
    if end < len(data) and truncate:
        os.truncate(path, end)
    for lineno, line in enumerate(data[:end].split(b"\n"), 1):  # not splitlines(): text may hold U+2028, U+0085
        if line.strip():
            try:
                rec = json.loads(line)
                done[rec["id"]] = rec
            except (ValueError, KeyError, TypeError):
                raise DraftheadsError(f"'{path}' line {lineno} is not a regenerated record (no JSON object with an "
                                      "'id'); remove that line (or the file, to regenerate everything) and rerun") \
                    from None
    return done


def plan_batches(tokenizer, conversations: list[Conversation], turns: int, batch_size: int,
                 max_prompt_tokens: int) -> tuple[list[list[tuple]], int]:
    """(batches of (n_prompt, id, system, user turns), prompts skipped as too long): sorted by prompt length, so every
    process and every rerun forms the same batches."""
    items, skipped_long = [], 0
    for i, conv in enumerate(conversations):
        system, users = _user_turns(conv, turns)
        if not users:
            continue
        n_prompt = len(prompt_ids(tokenizer, system + [{"role": "user", "content": users[0]}]))
        if n_prompt > max_prompt_tokens:
            skipped_long += 1
            continue
        items.append((n_prompt, i, system, users))
    items.sort(key=lambda x: (x[0], x[1]))
    return [items[j: j + batch_size] for j in range(0, len(items), batch_size)], skipped_long


def part_path(out_path: Path, rank: int, world: int) -> Path:
    return out_path if world == 1 else out_path.with_name(f"{out_path.stem}.part_{rank}-of-{world}{out_path.suffix}")


def record_files(out_path: Path) -> list[tuple[Path, int]]:
    """out_path and its part files of every process count, those that hold something: (path, process count). An
    empty one (a run killed before its first batch) holds no answers, so no settings either."""
    name = re.compile(rf"{re.escape(out_path.stem)}(?:\.part_\d+-of-(\d+))?{re.escape(out_path.suffix)}")
    found = sorted(out_path.parent.glob(f"{glob.escape(out_path.stem)}*{out_path.suffix}"))
    return [(path, int(m[1] or 1)) for path in found if (m := name.fullmatch(path.name)) and path.stat().st_size]


def _records_of(out_path: Path, but_count: int | None = None) -> dict[int, dict]:
    """Finished records of out_path and of its part files of every process count except `but_count` (a process's own
    file, and the parts that processes beside it are writing): a run resumed with another number of processes
    reuses the records another count made."""
    done: dict[int, dict] = {}
    for path, count in record_files(out_path):
        if count != but_count:
            done.update(_read_done(path))
    return done


def _progress_path(part: Path) -> Path:
    return part.with_name(part.name + PROGRESS)


def _no_progress() -> dict:
    return {"runs": 0, "new_tokens": 0, "seconds": 0.0}


def _read_progress(part: Path) -> dict:
    try:
        return json.loads(_progress_path(part).read_text())
    except (OSError, ValueError):  # none yet (or from before progress files): counts start here
        return _no_progress()


def regeneration_totals(out_path: str | Path) -> dict:
    """Generation over every run that wrote out_path or its parts, whatever its process count: new tokens, wall
    seconds (per process count the slowest part, as its parts ran side by side; runs of other counts ran one after
    another) and the tokens/s that makes. Counts whose record file is gone are not counted."""
    by_world: dict[int, list[dict]] = {}
    for path, count in record_files(Path(out_path)):
        by_world.setdefault(count, []).append(_read_progress(path))
    runs = sum(max(p["runs"] for p in parts) for parts in by_world.values())
    tokens = sum(p["new_tokens"] for parts in by_world.values() for p in parts)
    seconds = sum(max(p["seconds"] for p in parts) for parts in by_world.values())
    return {"runs": runs, "new_tokens": tokens, "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}


@torch.no_grad()
def regenerate(
    target: Target,
    conversations: list[Conversation],
    out_path: str | Path,
    max_new: int = 128,
    turns: int = 1,
    batch_size: int = 8,
    temperature: float = 0.0,
    seed: int = 0,
    max_prompt_tokens: int = 1024,
    dtype: str = "bfloat16",
    rank: int = 0,
    world: int = 1,
    backend: str = "runtime",
    server: str | None = None,
) -> dict:
    """Write one JSONL record per conversation: {"id", "conversation", "finished": [bool per turn]} (+ "served_model",
    the server's model id, with backend openai).
    With world > 1 this rank writes its batches to its part file (the main process then calls merge_parts).
    backend: "runtime" (the project's runtime on `target`) or "openai" (the chat server at `server`).

    Returns counts and tokens/s. Prompts longer than max_prompt_tokens are skipped and counted.
    """
    if backend not in ("runtime", "openai"):
        raise DraftheadsError(f"data.regen_backend '{backend}' is not 'runtime' or 'openai'")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    mine = part_path(out_path, rank, world)
    mine_done = _read_done(mine)
    elsewhere = _records_of(out_path, but_count=world)
    beside = {}  # what the other ranks wrote: after a re-plan (more records) their ids may fall in this rank's batches
    for r in (r for r in range(world) if r != rank):
        beside.update(_read_done(part_path(out_path, r, world), truncate=False))
    done = {**elsewhere, **beside, **mine_done}
    batches, skipped_long = plan_batches(target.tokenizer, conversations, turns, batch_size, max_prompt_tokens)
    decoder = None  # made for the first batch left to answer: finished answers read without a server
    new_tokens, t0 = 0, time.perf_counter()
    progress = _read_progress(mine) if mine_done else _no_progress()  # counts of a removed part file are void
    progress["runs"] += 1
    with open(mine, "a", encoding="utf-8") as f, tqdm(batches, desc="regenerate", unit="batch", position=rank) as bar:
        if world == 1:  # the parts of a run with more processes: into the one file, not made again
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for i, r in elsewhere.items() if i not in mine_done))
        for b, batch in enumerate(bar):
            if b % world != rank or all(i in done for _, i, _, _ in batch):
                continue
            if decoder is None and backend == "openai":
                decoder = ServerChat(server)
                decoder.check_made_by_this_model(done, out_path)
            decoder = decoder or RuntimeChat(target, dtype)
            t_batch = time.perf_counter()
            records, n_new = _generate_batch(decoder, batch, turns, max_new, temperature, seed * 1_000_003 + b)
            if backend == "openai":  # the served model's id: answers of another served model are not reused
                records = [{**r, "served_model": decoder.model} for r in records]
            new_tokens += n_new
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records if r["id"] not in done))
            f.flush()
            progress["new_tokens"] += n_new
            progress["seconds"] = round(progress["seconds"] + time.perf_counter() - t_batch, 3)
            write_atomic(_progress_path(mine), json.dumps(progress))
    elapsed = time.perf_counter() - t0
    return {"records": sum(map(len, batches)), "skipped_long_prompt": skipped_long, "new_tokens": new_tokens,
            "seconds": round(elapsed, 2), "tokens_per_s": round(new_tokens / max(elapsed, 1e-9), 1), "dtype": dtype}


def merge_parts(tokenizer, conversations: list[Conversation], out_path: str | Path, turns: int,
                batch_size: int, max_prompt_tokens: int) -> None:
    """The main process, after every rank finished: out_path = the parts' records in batch order (the file one process
    writes), then any others it held (answers to records past a lowered data.max_records: kept, not regenerated
    again), replaced atomically."""
    out_path = Path(out_path)
    records = _records_of(out_path)
    batches, _ = plan_batches(tokenizer, conversations, turns, batch_size, max_prompt_tokens)
    order = [i for batch in batches for _, i, _, _ in batch]
    missing = [i for i in order if i not in records]
    if missing:
        raise DraftheadsError(f"regeneration parts in '{out_path.parent}' lack {len(missing)} records (e.g. id "
                              f"{missing[0]}); rerun the same command to finish them")
    kept = order + sorted(set(records) - set(order))
    write_atomic(out_path, "".join(json.dumps(records[i], ensure_ascii=False) + "\n" for i in kept))


def _generate_batch(decoder, batch: list[tuple], turns: int, max_new: int, temperature: float,
                    seed: int) -> tuple[list[dict], int]:
    """Records of one batch, turn by turn (each turn follows the target's own previous answer), seeded per batch."""
    gen = torch.Generator().manual_seed(seed)
    chats = [list(system) for _, _, system, _ in batch]
    finished: list[list[bool]] = [[] for _ in batch]
    new_tokens = 0
    for turn in range(turns):
        active = [j for j, (_, _, _, users) in enumerate(batch) if turn < len(users)]
        if not active:
            break
        for j in active:
            chats[j].append({"role": "user", "content": batch[j][3][turn]})
        texts, n_new = decoder.generate([chats[j] for j in active], max_new, temperature, gen)
        for j, (text, done_flag) in zip(active, texts):
            chats[j].append({"role": "assistant", "content": text})
            finished[j].append(done_flag)
        new_tokens += n_new
    return [{"id": i, "conversation": chats[j], "finished": finished[j]} for j, (_, i, _, _) in enumerate(batch)], \
        new_tokens


class RuntimeChat:
    """The project's runtime as the generator: the target in the decoding dtype (a copy when it differs; features
    still come from the original), plain batched decoding."""

    def __init__(self, target: Target, dtype: str):
        torch_dtype = _parse_dtype(dtype)
        self.target = target if torch_dtype == target.dtype else Target(
            copy.deepcopy(target.model).to(torch_dtype), target.tokenizer, target.name, target.layer_ids)

    def generate(self, chats: list[Conversation], max_new: int, temperature: float,
                 gen: torch.Generator) -> tuple[list[tuple[str, bool]], int]:
        """(text, hit_eos) per chat and the tokens made, in one batched pass."""
        tok = self.target.tokenizer
        prompts = [prompt_ids(tok, c) for c in chats]
        runtime = Runtime(self.target, max_len=max(len(p) for p in prompts) + max_new + 1, batch_size=len(prompts),
                          row_invariant=False)  # plain decoding only: nothing to be equal to
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        out = runtime.generate(prompts, max_new, sampling=SamplingConfig(temperature=temperature), seed=seed)
        results, n_new = [], 0
        for row in out.tokens:
            hit_eos = bool(row) and row[-1] in runtime.eos
            body = row[:-1] if hit_eos else row
            n_new += len(row)
            results.append((tok.decode(body, skip_special_tokens=True), hit_eos))
        return results, n_new


class ServerChat:
    """An OpenAI-compatible chat server as the generator (vLLM, SGLang: tensor-parallel serving of targets too large
    for one device, as speculators and SpecForge regenerate). A batch's chats go out at once, one request each (the
    server batches them), greedy at temperature 0, seeded per request. The server applies the model's chat template."""

    def __init__(self, url: str, timeout: float = 3600.0):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.model = self._request("/models")["data"][0]["id"]

    def check_made_by_this_model(self, records: dict[int, dict], out_path: Path) -> None:
        """Records kept from an earlier run were answered by this server's model, or an error naming both."""
        other = {r["served_model"] for r in records.values() if r.get("served_model", self.model) != self.model}
        if other:
            raise DraftheadsError(f"'{out_path}' holds answers of the served model {sorted(other)[0]!r}; {self.url} "
                                  f"serves {self.model!r} now. Serve that model again, or delete '{out_path}' (and its "
                                  "part files) to regenerate with this one")

    def _request(self, path: str, body: dict | None = None) -> dict:
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.load(r)
        except (urllib.error.URLError, OSError) as e:
            raise DraftheadsError(f"regeneration server {self.url} did not answer {path} ({e}); start one (e.g. "
                                  "python -m vllm.entrypoints.openai.api_server --model DIR) and set "
                                  "data.regen_server, or use data.regen_backend=runtime") from None

    def generate(self, chats: list[Conversation], max_new: int, temperature: float,
                 gen: torch.Generator) -> tuple[list[tuple[str, bool]], int]:
        from concurrent.futures import ThreadPoolExecutor

        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))

        def one(j: int):
            out = self._request("/chat/completions", {"model": self.model, "messages": chats[j], "max_tokens": max_new,
                                                      "temperature": temperature, "seed": seed + j})
            choice = out["choices"][0]
            return (choice["message"]["content"], choice["finish_reason"] == "stop"), out["usage"]["completion_tokens"]

        with ThreadPoolExecutor(max_workers=len(chats)) as pool:
            answers = list(pool.map(one, range(len(chats))))
        return [a for a, _ in answers], sum(n for _, n in answers)
