"""The data stage of a run: read → (regenerate) → tokenize with the chat template → sequences on disk, with the
target's hidden states (data.features=offline) or without (online: the training step recomputes them).

Every step writes to the run's data directory and is skipped or resumed when its output already exists. Several
processes share the stage: each regenerates and extracts its share, the main process merges. `data_report.json`
records the settings that shaped the data (`data_settings`); a run with the same settings and a complete feature
directory skips the stage without loading the target.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from data.chat import tokenize_chat, tokenize_text
from data.features import MANIFEST, extract_features, merge_parts
from data.readers import DOCUMENT_SOURCES, PROMPT_SOURCES, ReadStats, read_conversations, read_text_dir, text_files
from data.regenerate import merge_parts as merge_regenerated
from data.regenerate import record_files, regenerate, regeneration_totals
from models.errors import DraftheadsError
from models.files import write_atomic
from models.target import Target, dtype_name

FEATURE_MODES = ("offline", "online", "none")
REGEN_SHAPING = ("source", "path", "max_records", "skip_records", "max_length", "regenerate", "regen_max_new",
                 "regen_turns", "regen_batch_size", "regen_temperature", "regen_dtype", "regen_backend")
SHAPING = REGEN_SHAPING + ("overlong", "features", "feature_dtype")


@dataclass
class Workers:
    """The processes sharing a stage's work (the data stage, the τ table): this one's rank, how many, a barrier, and
    gather (each process's list -> all of them concatenated in rank order, on every process). One process: no-ops."""
    rank: int = 0
    world: int = 1
    wait: Callable[[], None] = lambda: None
    gather: Callable[[list], list] = lambda items: items


def weights_identity(path: str | None, dtype: str) -> dict:
    """Which weights the target was loaded from, beyond its name: target.path (resolved) when given, target.dtype when
    not float32. Empty for the built-in weights in float32, so data made before this key existed keeps its key."""
    return recorded_weights(({"path": str(Path(path).expanduser().resolve())} if path else {}) | {"dtype": dtype})


def recorded_weights(weights: dict) -> dict:
    """A weights identity in one spelling: the dtype as `dtype_name` spells it, none for float32 (data reports written
    before spellings were unified record the dtype as given)."""
    dtype = dtype_name(weights.get("dtype") or "float32")
    return {k: v for k, v in weights.items() if k != "dtype"} | ({"dtype": dtype} if dtype != "float32" else {})


def source_stamp(path: str | None) -> dict:
    """What data.path holds, cheaply: bytes and modification time of the file (of every file a text directory's
    reader reads, digested; not .git and the like), so data edited in place is other data rather than a stale cache.
    Empty without data.path (the packaged copies), so their keys stay what they were."""
    if not path or not Path(path).expanduser().exists():
        return {}  # the reader names a missing path
    root = Path(path).expanduser()
    files = text_files(root) if root.is_dir() else [root]
    stats = [(str(f.relative_to(root)) if root.is_dir() else f.name, f.stat().st_size, f.stat().st_mtime_ns)
             for f in files]
    return {"path_files": {"files": len(stats), "bytes": sum(s[1] for s in stats), "sha256": _digest(stats)}}


def data_seed(d, seed: int) -> int:
    """train.seed where it shapes the data (answers sampled at data.regen_temperature > 0), else 0: greedy answers are
    the same under every seed, so a run with another training seed reuses the data instead of regenerating it."""
    return seed if d.regenerate and d.regen_temperature > 0 else 0


def data_settings(d, fingerprint: dict, seed: int, weights: dict | None = None) -> dict:
    """What shapes the data directory's content: the data.* fields that change records or tokens, what the files at
    data.path hold (`source_stamp`), the target (name, tokenizer, feature layers, `weights_identity`) and `data_seed`;
    shard sizes do not. `regen_sha256` keys the regenerated text alone (the feature layers do not shape it, nor
    target.dtype unless `rounded_weights`), so heads reading other layers share one regeneration. The chat
    template's hash is recorded beside them and checked on reuse (ready_report, the regeneration stamp) rather than
    keyed, so caches made before it still open."""
    keep = {k: getattr(d, k) for k in SHAPING} | source_stamp(d.path)
    keep["regen_dtype"] = dtype_name(keep["regen_dtype"])  # bf16 and bfloat16 regenerate alike
    keep["target"] = {k: fingerprint[k] for k in ("name", "tokenizer_hash", "layer_ids")} | \
        ({"weights": weights} if weights else {})
    keep["seed"] = data_seed(d, seed)
    keep["sha256"] = _digest(keep)
    regen_target = {k: fingerprint[k] for k in ("name", "tokenizer_hash")}
    if weights and "path" in weights:
        regen_target["path"] = weights["path"]
    if rounded := rounded_weights(keep):
        regen_target["dtype"] = rounded
    regen = {k: keep[k] for k in REGEN_SHAPING + ("seed", "path_files") if k in keep}
    keep["regen_sha256"] = _digest({**regen, "target": regen_target})
    keep["chat_template"] = fingerprint.get("chat_template_hash", "")  # checked on reuse, not keyed: older keys hold
    return keep


def rounded_weights(settings: dict) -> str | None:
    """target.dtype when the runtime regenerates in another data.regen_dtype from weights rounded to it (a float32
    copy of bfloat16 weights answers otherwise than the float32 weights): then it shapes the regenerated text."""
    dtype = settings["target"].get("weights", {}).get("dtype")
    if dtype is None or settings["regen_backend"] != "runtime":
        return None
    return dtype if dtype not in ("float32", settings["regen_dtype"]) else None  # both as dtype_name spells them


def _digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def ready_report(out_dir: str | Path, settings: dict) -> dict | None:
    """The data report when the directory holds complete data made with exactly `settings`, else None."""
    out = Path(out_dir)
    try:
        report = json.loads((out / "data_report.json").read_text())
        made = report.get("settings", {})
        if made.get("sha256") != settings["sha256"] or made.get("chat_template", settings["chat_template"]) != \
                settings["chat_template"]:
            return None
        manifest = json.loads((out / "features" / MANIFEST).read_text()) if settings["features"] != "none" else None
        if manifest is not None and not (manifest["complete"] and
                                         manifest["sequences_done"] == report["tokenize"]["sequences"]):
            return None  # unfinished, or extended past this report by a later (killed) run
    except (OSError, ValueError, KeyError):  # missing or damaged: the data stage checks (and resumes) everything
        return None
    return report


def prepare_data(target: Target, out_dir: str | Path, d, seed: int = 0, workers: Workers = Workers(),
                 regenerated: str | Path | None = None, weights: dict | None = None) -> dict:
    """Run the data stage with the data config `d` (conf.schema.DataConfig); every rank calls it. Returns the report
    (written to out_dir/data_report.json by the main process). `regenerated`: where the regenerated conversations
    are (or go), out_dir/regenerated.jsonl by default; a shared file is reused by runs with the same regen_sha256.
    weights: `weights_identity` of the target."""
    if d.features not in FEATURE_MODES:
        raise DraftheadsError(f"data.features '{d.features}' is not one of {list(FEATURE_MODES)}")
    seed = data_seed(d, seed)
    out = Path(out_dir)
    regenerated = Path(regenerated) if regenerated else out / "regenerated.jsonl"
    main = workers.rank == 0
    if main:
        out.mkdir(parents=True, exist_ok=True)
    workers.wait()
    stats = ReadStats()
    documents = d.source in DOCUMENT_SOURCES  # trained on as they are: no chat template, no regeneration
    read = read_text_dir(_path_of(d), stats=stats) if documents else read_conversations(d.source, d.path, stats)
    convs = list(itertools.islice(read, d.skip_records, d.skip_records + d.max_records))
    if not convs:
        raise DraftheadsError(f"data source '{d.source}' ({d.path or 'packaged copy'}) gave no usable records "
                              f"(read stats: {stats.summary()}); check data.source / data.path")
    if d.source in PROMPT_SOURCES and not d.regenerate:
        raise DraftheadsError(f"data.source={d.source} holds prompts only: set data.regenerate=true so the target "
                              "answers them")
    report: dict = {"settings": data_settings(d, target.fingerprint, seed, weights), "read": stats.summary(),
                    "conversations": len(convs), "processes": workers.world}
    if documents:
        chats = []
    elif d.regenerate:
        check_regeneration_settings(regenerated, report["settings"], main)
        max_prompt = max(d.max_length - d.regen_max_new, 1)
        report["regenerate"] = regenerate(
            target, convs, regenerated, max_new=d.regen_max_new, turns=d.regen_turns,
            batch_size=d.regen_batch_size, temperature=d.regen_temperature, seed=seed, dtype=d.regen_dtype,
            max_prompt_tokens=max_prompt, rank=workers.rank, world=workers.world, backend=d.regen_backend,
            server=d.regen_server)
        report["regenerate"] = _over_processes(report["regenerate"], workers)
        if workers.world > 1:
            workers.wait()
            if main:
                merge_regenerated(target.tokenizer, convs, regenerated, d.regen_turns, d.regen_batch_size, max_prompt)
            workers.wait()
        report["regenerate"]["all_runs"] = regeneration_totals(regenerated)  # resumes included
        lines = regenerated.read_bytes().split(b"\n")
        records = [r for r in map(json.loads, filter(bytes.strip, lines))
                   if r["id"] < len(convs)]  # records past a lowered data.max_records stay on disk, unused
        records.sort(key=lambda r: r["id"])
        chats = [(r["conversation"], [not f for f in r["finished"]]) for r in records]
    else:
        chats = [(c, None) for c in convs]
    sequences, overlong_count = [], 0
    tokenized = ((tokenize_text(target.tokenizer, doc, d.max_length, d.overlong) for doc in convs) if documents else
                 (tokenize_chat(target.tokenizer, c, d.max_length, d.overlong, open_turns=o) for c, o in chats))
    for tc in tokenized:
        if tc is None or tc.truncated:
            overlong_count += 1
        if tc is not None and tc.loss_mask.any():
            sequences.append((tc.input_ids, tc.loss_mask))
    report["tokenize"] = {"sequences": len(sequences), f"overlong_{d.overlong}d": overlong_count,
                          "tokens": sum(len(s[0]) for s in sequences),
                          "assistant_tokens": int(sum(int(s[1].sum()) for s in sequences))}
    if d.features != "none":
        report["features"] = _sequences_on_disk(target, sequences, out / "features", d, workers, weights)
    if main:
        write_atomic(out / "data_report.json", json.dumps(report, indent=1))
    workers.wait()
    return report


def check_regeneration_settings(regenerated: Path, settings: dict, main: bool) -> None:
    """Records already in `regenerated` (or its processes' part files) are reused by id: only when they were made with
    these settings (a lower data.max_records is extended). Otherwise an error naming what changed. The settings are
    stamped beside the file by the main process."""
    stamp = regenerated.with_name(regenerated.name + ".settings.json")
    now = {f"data.{k}": settings[k] for k in REGEN_SHAPING if k != "max_records"} | \
        {"train.seed": settings["seed"], "target.name": settings["target"]["name"],
         "target.path": settings["target"].get("weights", {}).get("path"),
         "target's chat template": settings["chat_template"]}
    if "path_files" in settings:
        now["data.path's files"] = settings["path_files"]
    if rounded := rounded_weights(settings):
        now["target.dtype"] = rounded
    try:
        before = json.loads(stamp.read_text())
        before.setdefault("data.path's files", now.get("data.path's files"))  # stamped before files were
        before.setdefault("target's chat template", now["target's chat template"])  # or templates
        if not (settings["regenerate"] and settings["regen_temperature"] > 0):  # stamped with train.seed as given
            before["train.seed"] = 0  # before greedy answers stopped depending on it (data_seed)
        for key in ("data.regen_dtype", "target.dtype"):  # and dtypes as spelled (dtype_name)
            if before.get(key) is not None:
                before[key] = dtype_name(before[key])
    except FileNotFoundError:
        before = now  # no stamp (a file from before stamps existed): taken as made with these settings
    except ValueError:
        before = {}  # damaged: unknown settings, the same as other ones
    diff = [f"{k}: {before.get(k)!r} there, {now[k]!r} now" for k in sorted(now) if before.get(k) != now[k]]
    if diff and record_files(regenerated) and all(d.startswith("target's chat template") for d in diff):
        raise DraftheadsError(f"'{regenerated}' holds answers to prompts built with another chat template than the "
                              "target's now (caches are not keyed by it); delete it and its '.settings.json' to "
                              "regenerate under this template, or restore the template")
    if diff and record_files(regenerated):
        raise DraftheadsError(f"'{regenerated}' holds answers regenerated with other settings ({'; '.join(diff[:4])}); "
                              "rerun with those settings, use another output_dir (or data.cache_dir, which keeps one "
                              f"file per setting), or delete '{regenerated}' and its '.settings.json' to regenerate")
    if main and (before != now or not stamp.exists()):
        regenerated.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(stamp, json.dumps(now, indent=1, sort_keys=True))


def _over_processes(stats: dict, workers: Workers) -> dict:
    """A stage's figures over the processes that ran it side by side (every rank calls this): new tokens summed, the
    slowest process's seconds, the tokens/s they make together, and each process's own figures."""
    if workers.world == 1:
        return stats
    each = workers.gather([{k: stats[k] for k in ("new_tokens", "seconds", "tokens_per_s")}])
    tokens, seconds = sum(e["new_tokens"] for e in each), max(e["seconds"] for e in each)
    return {**stats, "new_tokens": tokens, "seconds": seconds, "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
            "per_process": each}


def _path_of(d) -> str:
    if not d.path:
        raise DraftheadsError(f"data.source={d.source} needs data.path (a directory of text or code files)")
    return d.path


def _sequences_on_disk(target: Target, sequences, out: Path, d, workers: Workers, weights: dict | None) -> dict:
    """Offline: every rank extracts its block of hidden states, the main process merges. Online: tokens only, written
    by the main process (cheap)."""
    hidden = d.features == "offline"
    per_token = 5 + (len(target.layer_ids) + 1) * target.hidden_size * (2 if d.feature_dtype == "bfloat16" else 1)
    shard_tokens = max(1, int(d.shard_mb * 2**20 / (per_token if hidden else 5)))
    if not hidden or workers.world == 1:
        stats = extract_features(target, sequences, out, shard_tokens, hidden=hidden, dtype=d.feature_dtype,
                                 weights=weights) if workers.rank == 0 else {}
        workers.wait()
        return stats
    stats = _over_processes(extract_features(target, sequences, out, shard_tokens, hidden=True,
                                             dtype=d.feature_dtype, rank=workers.rank, world=workers.world,
                                             weights=weights), workers)
    if workers.rank == 0:
        merged = merge_parts(out, workers.world)
        stats = {**stats, "sequences": merged["sequences_done"], "tokens": sum(s["tokens"] for s in merged["shards"]),
                 "bytes": sum((out / s["file"]).stat().st_size for s in merged["shards"])}
        stats["bytes_per_token"] = round(stats["bytes"] / max(stats["tokens"], 1), 1)
    workers.wait()
    return stats
