"""Draft-file benchmark: build throughput and memory at several corpus sizes with the 1B-token extrapolation,
file size, coverage, lookup latency (single and batched; compiled and numpy reference), hot/cold hit rates, tau.

    # the measurement, on 2 idle cores (~10 min; the first run also writes the corpus, ~1 min): builds of
    # ~25M, ~50M and ~100M tokens at min-count 2, then lookups and hot/cold placement on the largest file
    mkdir -p outputs/draft_file && RAYON_NUM_THREADS=2 .venv/bin/python -m eval.draft_file_bench \
        --out outputs/draft_file/big.dfl --tokens 25e6,50e6,100e6 --threads 2 > outputs/draft_file/bench_2core.json
    # per core, while developing (the tokenizer's pool, numpy and the workers on one CPU):
    RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python -m eval.draft_file_bench \
        --out outputs/draft_file/dev.dfl --tokens 25e6,50e6 --threads 1 > outputs/draft_file/bench_1core.json
    # --coverage C sizes each table for validation coverage C instead (a second count pass per build)
    # lookups alone on a file built before (compiled and numpy reference, same contexts):
    python -m eval.draft_file_bench --latency-only --out outputs/draft_file/big.dfl
    # tau on HumanEval (code) and MT-bench (chat), K = 4 and 8, prompt lookup alone vs file + prompt lookup:
    python -m eval.draft_file_bench --tau-only --out outputs/draft_file/big.dfl --tau-limit 8 --max-new 64
    # or through eval.acceptance ("draft_file" is registered in inference/sources/__init__.py; the bench
    # writes outputs/draft_file/humaneval.jsonl, HumanEval prompts in its --prompts format):
    python -m eval.acceptance --prompts outputs/draft_file/humaneval.jsonl --source draft_file:outputs/draft_file/big.dfl \
        --k 4 --max-new 64 --out outputs/acc/dfl_he_k4.json

The corpus: every .py file of the Python stdlib and of site-packages (this venv's and the interpreter's,
identical files once), HumanEval problems with their solutions and tests, and the packaged ShareGPT records
(rendered with the chat template by data.readers.iter_documents), in one JSONL shuffled by content hash so
every prefix has the same mix. A size N is the prefix of ~N tokens (chars per token measured on a sample).
The 1B-token time and size are extrapolated from the sizes measured (a line through them, and a power law).
Prints progress, then ONE JSON line last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from data.draft_file import DraftFile
from data.draft_file_build import build, load_tokenizer, stats
from data.draft_file_tokenize import batch_encoder
from eval.machine import machine_info

STDLIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")  # its site-packages included


def rss_mb() -> float:
    """Peak resident set (MB), memory-mapped file pages included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def anon_mb() -> float:
    """RssAnon: private memory, not file pages the kernel can drop (MB)."""
    return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("RssAnon:"))


class AnonPeak(threading.Thread):
    """Samples RssAnon every 50 ms; .peak_mb."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_mb, self.running = 0.0, True

    def run(self):
        while self.running:
            self.peak_mb = max(self.peak_mb, anon_mb())
            time.sleep(0.05)


def write_corpus(path: Path, code_roots: list[Path]) -> Path:
    """All documents as {"text"} / {"conversations"} JSONL lines, shuffled by content hash (written once)."""
    from data.readers import ReadStats, humaneval_path, iter_json_array, iter_jsonl, sharegpt_path

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = {}  # content hash -> line: identical files count once
    for root in code_roots:
        for p in sorted(root.rglob("*.py")):
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                lines.setdefault(hashlib.blake2b(text.encode(), digest_size=16).digest(), json.dumps({"text": text}))
    for rec in iter_jsonl(humaneval_path(), ReadStats()):
        text = rec["prompt"] + rec["canonical_solution"] + "\n\n" + rec["test"]
        lines.setdefault(hashlib.blake2b(text.encode(), digest_size=16).digest(), json.dumps({"text": text}))
    for rec in iter_json_array(sharegpt_path(), ReadStats()):
        line = json.dumps(rec)
        lines.setdefault(hashlib.blake2b(line.encode(), digest_size=16).digest(), line)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for h in sorted(lines):
            f.write(lines[h] + "\n")
    tmp.rename(path)
    return path


def prefix_corpus(corpus: Path, tokens: float, tokenizer, out: Path) -> Path:
    """The first lines of the corpus holding ~`tokens` tokens (JSONL chars per token measured on 4M chars)."""
    from data.readers import iter_documents

    with open(corpus) as src, open(out, "w") as dst:
        sample = 0
        for line in src:
            dst.write(line)
            sample += len(line)
            if sample > 4_000_000:
                break
    n = sum(len(ids) for ids in batch_encoder(tokenizer)(list(iter_documents(out, tokenizer))))
    budget, size = tokens * sample / max(n, 1), 0
    with open(corpus) as src, open(out, "w") as dst:
        for line in src:
            if size >= budget:
                break
            dst.write(line)
            size += len(line)
    return out


def write_humaneval_prompts(path: Path) -> Path:
    """HumanEval as eval.acceptance prompt JSONL ({"question_id", "category", "turns"})."""
    from data.readers import read_humaneval

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in read_humaneval():
            f.write(json.dumps({"question_id": rec["id"], "category": "humaneval", "turns": rec["turns"]}) + "\n")
    return path


def validation_contexts(f: DraftFile, n: int, seed: int = 0) -> np.ndarray:
    """Contexts [n, W] (newest last, -1 = before the document start) at random validation positions."""
    toks, offs = f.val_tokens.astype(np.int64), f.val_offsets.astype(np.int64)
    if len(toks) < 2:
        toks, offs = f.corpus_tokens.astype(np.int64), f.doc_offsets.astype(np.int64)  # fall back: seen text
    W = max(f.orders)
    pos = np.random.default_rng(seed).integers(0, len(toks) - 1, size=n)
    start = offs[np.searchsorted(offs, pos, side="right") - 1]
    idx = pos[:, None] - np.arange(W - 1, -1, -1)[None, :]
    return np.where(idx >= start[:, None], toks[np.maximum(idx, 0)], -1)


def latency(f: DraftFile, ctx: np.ndarray, batch: int = 64, repeats: int = 2000) -> dict:
    single_ctx = [row[row >= 0] for row in ctx[:repeats]]
    for c in single_ctx[:100]:  # warm the page cache and the code paths
        f.lookup(c)
    single = []
    for c in single_ctx:
        t = time.perf_counter()
        f.lookup(c)
        single.append(time.perf_counter() - t)
    batched = []
    for i in range(0, min(len(ctx), repeats * 4) - batch + 1, batch):
        t = time.perf_counter()
        f.lookup_batch(ctx[i: i + batch])
        batched.append(time.perf_counter() - t)
    us = lambda xs, q: round(float(np.percentile(xs, q)) * 1e6, 2)  # noqa: E731
    return {"single_p50_us": us(single, 50), "single_p99_us": us(single, 99),
            f"batch{batch}_p50_us": us(batched, 50), f"batch{batch}_p99_us": us(batched, 99),
            f"batch{batch}_p50_us_per_context": round(us(batched, 50) / batch, 2)}


def lookup_latencies(f: DraftFile, contexts: int) -> dict:
    """Lookup latency of the compiled lookups and of their numpy reference (data/draft_file.py), same contexts."""
    ctx = validation_contexts(f, contexts)
    reference = DraftFile(f.path, verify=False)
    reference.use_compiled = False
    return {"latency_cpu": latency(f, ctx), "latency_cpu_numpy_reference": latency(reference, ctx),
            "compiled_lookups": f._compiled is not None}


def hot_cold(path: Path, ctx: np.ndarray, fractions=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0), device="cpu") -> list[dict]:
    rows = []
    for x in fractions:
        f = DraftFile(path, verify=False)
        placed = f.place_hot(x, device)
        rows.append({**placed, **f.hot_hit_rate(ctx)})
    return rows


def tau(path: Path, limit: int, max_new: int, ks=(4, 8), threads: int = 1) -> dict:
    """tau per prompt set, K and source; through eval.acceptance.measure (the same loop as its CLI)."""
    from data.readers import read_humaneval
    from eval.acceptance import load_prompts, measure
    from inference.sampling import SamplingConfig
    from inference.sources.draft_file import DraftFileSource
    from inference.stats import DecodeStats
    from inference.sources.prompt_lookup import PromptLookup
    from models.target import load_target

    torch.set_num_threads(threads)
    target = load_target()
    bench = Path(__file__).resolve().parent / "data" / "spec_bench_dev.jsonl"  # bundled Spec-Bench prompts
    sets = {"humaneval": list(read_humaneval())[:limit],
            "mt_bench": load_prompts(bench, categories=["mt_bench"], limit=limit)}
    sources = {"prompt_lookup": lambda: PromptLookup(),
               "draft_file+prompt_lookup": lambda: DraftFileSource(path, target=target)}
    out = {}
    for set_name, prompts in sets.items():
        for k in ks:
            for name, make in sources.items():
                source = make()
                categories, _ = measure(target, source, prompts, k, SamplingConfig(), max_new, progress=False)
                s = sum(categories.values(), DecodeStats(k=k)).summary()  # as eval.acceptance's "overall"
                row = {key: s[key] for key in ("tau", "mean_draft_len", "acceptance", "draft_ms_per_round", "tokens",
                                               "rounds")}
                if hasattr(source, "stats"):
                    row["answered_by"] = dict(source.stats)
                out[f"{set_name}/k{k}/{name}"] = row
                print(json.dumps({f"{set_name}/k{k}/{name}": row}), file=sys.stderr)
    return out


def extrapolate(rows: list[dict], at: float = 1e9) -> dict:
    """Build seconds and file bytes at `at` tokens from the measured sizes: a line, and a power law."""
    n = np.array([r["tokens"] for r in rows], dtype=float)
    out = {"tokens": int(at)}
    for key in ("total_s", "cpu_s", "file_bytes", "peak_anon_mb"):
        y = np.array([r[key] for r in rows], dtype=float)
        if len(rows) < 2:
            out[key] = {"linear": round(float(y[0] * at / n[0]), 1)}
            continue
        slope, icept = np.polyfit(n, y, 1)
        power, scale = np.polyfit(np.log(n), np.log(np.maximum(y, 1e-9)), 1)
        out[key] = {"linear": round(float(icept + slope * at), 1),
                    "power_law": round(float(np.exp(scale) * at ** power), 1), "exponent": round(float(power), 3)}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m eval.draft_file_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="outputs/draft_file/bench.dfl", help="the largest size's file (the rest beside)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", default="25e6,50e6,100e6", help="corpus sizes to build, comma-separated")
    ap.add_argument("--code-roots", default=f"{STDLIB},{Path(sys.prefix) / 'lib/python3.11/site-packages'}")
    ap.add_argument("--coverage", type=float, default=None, help="size the table for this validation coverage")
    ap.add_argument("--min-count", type=int, default=2)
    ap.add_argument("--memory-mb", type=int, default=1024)
    ap.add_argument("--contexts", type=int, default=8192, help="validation contexts for latency / hot-cold")
    ap.add_argument("--tau", action="store_true", help="also measure tau with SmolLM2 (minutes)")
    ap.add_argument("--tau-only", action="store_true", help="skip the build, measure tau with an existing --out")
    ap.add_argument("--latency-only", action="store_true", help="skip the build, time lookups in an existing --out")
    ap.add_argument("--tau-limit", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="build workers and torch threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    write_humaneval_prompts(out.parent / "humaneval.jsonl")
    result = {"bench": "draft_file", "threads": args.threads, "machine": machine_info()}
    if args.latency_only:
        result.update(lookup_latencies(DraftFile(out), args.contexts))
    elif not args.tau_only:
        tokenizer, name, vocab = load_tokenizer(args.target)
        corpus = write_corpus(out.parent / "corpora" / "all.jsonl", [Path(p) for p in args.code_roots.split(",")])
        sizes = sorted(float(t) for t in args.tokens.split(","))
        result["builds"] = []
        for i, size in enumerate(sizes):
            path = out if i == len(sizes) - 1 else out.with_name(f"{out.stem}_{size / 1e6:g}M{out.suffix}")
            part = prefix_corpus(corpus, size, tokenizer, out.parent / "corpora" / f"prefix_{size / 1e6:g}M.jsonl")
            anon, before = AnonPeak(), anon_mb()
            anon.start()
            report = build([str(part)], tokenizer, path, target_name=name, vocab_size=vocab, min_count=args.min_count,
                           coverage=args.coverage, memory_mb=args.memory_mb, threads=args.threads, progress=True,
                           log=lambda m: print(m, file=sys.stderr, flush=True))
            anon.running = False
            row = {**{k: v for k, v in report.items() if k != "selected"},
                   "tokens_per_s": round(report["tokens"] / report["total_s"]),
                   "tokens_per_cpu_s": round(report["tokens"] / report["cpu_s"]),
                   "peak_anon_mb": round(anon.peak_mb - before)}  # what the build added to the process
            result["builds"].append(row)
            print(json.dumps({"build": row}), file=sys.stderr, flush=True)
        result["peak_rss_mb"] = round(rss_mb())
        result["extrapolated"] = extrapolate(result["builds"])
        f = DraftFile(out)
        s = stats(f)
        result["file"] = {k: s[k] for k in ("keys", "entries", "file_bytes", "table_bytes", "min_count",
                                            "val_hit_rate", "val_coverage", "per_order")}
        result["coverage_curve"] = [{k: c[k] for k in ("min_count", "table_bytes_bound", "hit_rate", "coverage")}
                                    for c in f.header["validation"]["curve"]]
        result.update(lookup_latencies(f, args.contexts))
        result["hot_cold"] = hot_cold(out, validation_contexts(f, args.contexts))
        print(json.dumps({k: result[k] for k in ("builds", "extrapolated", "latency_cpu")}), file=sys.stderr)
    if args.tau or args.tau_only:
        result["tau"] = tau(out, args.tau_limit, args.max_new, threads=args.threads)
    print(json.dumps(result))


if __name__ == "__main__":
    from models.errors import exit_on_error

    exit_on_error(main)
