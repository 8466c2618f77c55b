"""Acceptance benchmark: tau and per-position acceptance of a draft source against the target, per category.

    python -m eval.acceptance --prompts eval/data/spec_bench_dev.jsonl --source prompt_lookup \
        --temperature 0 --max-new 64 --k 4 --categories mt_bench --limit 16 --out outputs/acc/pl_k4.json

Multi-turn prompts are answered turn by turn: turn 2 follows the target's own turn-1 answer, each turn
rendered with the target's chat template and the generation prompt. Reported per category and overall:
tau (tokens emitted per verification forward, bonus included), acceptance[j] = P(position j accepted |
position j-1 accepted) over rounds where position j was drafted and verified, mean draft length per round.
Every source runs through the runtime (inference/runtime.py, batch 1: the engine eval.speedup times), where for a
token tree (e.g. head:DIR,tree=1) position j is tree depth j and --k is the node budget. The HF-cache reference loop
(inference/generate.py, the tests' oracle) runs only targets the runtime does not cover, or with --engine reference.
Writes JSON + a Markdown table (.md next to it), prints the table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from data.chat import prompt_ids
from data.prepare import Workers
from conf.schema import at_least, between, check_args
from eval.plots import plot_tau_table
from inference.threads import available_threads
from eval.report import markdown_table, write_report
from inference.generate import speculative_generate
from inference.sampling import SamplingConfig
from inference.stats import DecodeStats, Generation
from models.errors import DraftheadsError, cli
from models.files import check_writable

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORY_ALIASES = {"mt_bench": MT_BENCH}


CLI_RULES = {"k": between(1, 64), "max_new": at_least(1), "limit": at_least(1), "skip": at_least(0),
             "threads": between(0, 1024),
             "temperature": at_least(0), "top_p": between(1e-9, 1), "top_k": at_least(0), "seed": at_least(0)}


def parse_categories(spec: str | None) -> list[str] | None:
    """'writing, coding' -> ['writing', 'coding'] (spaces and empty entries dropped); None -> None."""
    names = [c.strip() for c in spec.split(",") if c.strip()] if spec else []
    return names or None


def load_prompts(path: str | Path, categories: list[str] | None = None, limit: int | None = None,
                 skip: int = 0) -> list[dict]:
    """Prompts {question_id, category, turns} from a JSONL file (data.readers.read_prompts, strict: a malformed line
    is an error naming it) or "humaneval" (the packaged problems), after `skip` records, filtered by category.

    --limit keeps `limit` prompts taken round-robin over categories (file order inside each), so a small
    limit still covers every category.
    """
    from data.readers import read_humaneval, read_prompts

    records = read_humaneval() if str(path) == "humaneval" else read_prompts(path, strict=True)
    prompts = list(records)[skip:]
    if categories:
        wanted = [c for name in categories for c in CATEGORY_ALIASES.get(name, (name,))]
        present = {p["category"] for p in prompts}
        unknown = sorted(set(categories) - present - set(CATEGORY_ALIASES))  # an alias may match a subset
        if unknown:
            raise DraftheadsError(f"--categories {','.join(unknown)} not in '{path}'; it has "
                                  f"{','.join(sorted(present))} (alias: mt_bench)")
        prompts = [p for p in prompts if p["category"] in wanted]
    if limit is not None:
        by_category = defaultdict(list)
        for p in prompts:
            by_category[p["category"]].append(p)
        queues = list(by_category.values())
        interleaved = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
        prompts = interleaved[:limit]
    if not prompts:
        raise DraftheadsError(f"no prompts left from '{path}' after --categories/--limit; widen the selection")
    return prompts


def generate_turn(runtime, target, source, ids, max_new: int, k: int, sampling: SamplingConfig,
                  seed: int) -> Generation:
    """One turn through the runtime (batch 1), or the reference loop when `runtime` is None."""
    if runtime is None:
        return speculative_generate(target, source, ids, max_new, k, sampling, seed=seed)
    return runtime.generate([ids], max_new, source, sampling=sampling, k=k, seed=seed)


def category_summary(stats: DecodeStats, turns: list[dict]) -> dict:
    """A category's (or all categories') DecodeStats summary, with the prompts its turns came from."""
    return {"prompts": sum(t["turn"] == 0 for t in turns), **stats.summary()}


def resolve_engine(engine: str, target) -> str:
    """'auto' -> the runtime for every target it covers (Llama-style), else the reference loop."""
    from inference.llama import runtime_supports

    return engine if engine != "auto" else "runtime" if runtime_supports(target) else "reference"


def measure(target, source, prompts: list[dict], k: int, sampling: SamplingConfig, max_new: int, seed: int = 0,
            progress: bool = True, save_tokens: bool = False, engine: str = "auto",
            workers: Workers = Workers()) -> tuple[dict[str, DecodeStats], list[dict]]:
    """Run every prompt (all its turns) -> ({category: DecodeStats}, one record per turn in order); save_tokens
    keeps each turn's output ids in its record.
    engine: 'runtime', 'reference' (chains only: the oracle), or 'auto' (see resolve_engine).
    workers: several processes each answer every world-th prompt (seeds follow the prompt, not the process) and every
    process returns the whole result, in prompt order: what one process returns."""
    from tqdm import tqdm

    runtime = None
    if resolve_engine(engine, target) == "runtime":
        from inference.runtime import Runtime

        runtime = Runtime(target, max_len=4096, batch_size=1)
    mine = [(i, p) for i, p in enumerate(prompts) if i % workers.world == workers.rank]
    done = [(i, _answer(runtime, target, source, prompt, i, k, sampling, max_new, seed, save_tokens))
            for i, prompt in tqdm(mine, desc=f"acceptance {source.name} k={k}", file=sys.stderr, dynamic_ncols=True,
                                  disable=not progress or workers.rank != 0)]
    done = sorted(workers.gather(done), key=lambda x: x[0])  # one process: its own answers, already in order
    categories: dict[str, DecodeStats] = {}
    turns: list[dict] = []
    for _, answered in done:
        for record, stats in answered:
            total = categories.setdefault(record["category"], DecodeStats())
            total += stats
            turns.append(record)
    return categories, turns


def _answer(runtime, target, source, prompt: dict, i: int, k: int, sampling: SamplingConfig, max_new: int,
            seed: int, save_tokens: bool) -> list[tuple[dict, DecodeStats]]:
    """Prompt i's turns, each after the target's own answer to the one before: (record, stats) per turn."""
    messages, answered = [], []
    for turn, user in enumerate(prompt["turns"]):
        messages.append({"role": "user", "content": user})
        ids = prompt_ids(target.tokenizer, messages)  # chat template + generation prompt
        gen = generate_turn(runtime, target, source, ids, max_new, k, sampling, seed + 1000 * i + turn)
        output = gen.tokens[0]
        answered.append(({"question_id": prompt.get("question_id", i), "category": prompt["category"], "turn": turn,
                          "tokens": len(output), "rounds": gen.stats.rounds, "tau": round(gen.stats.tau, 4),
                          **({"output_ids": output} if save_tokens else {})}, gen.stats))
        messages.append({"role": "assistant", "content": target.tokenizer.decode(output, skip_special_tokens=True)})
    return answered


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m eval.acceptance", description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", required=True, help="JSONL with 'category' and 'turns' (list of user messages)")
    ap.add_argument("--source", required=True, help="draft source spec, e.g. prompt_lookup or prompt_lookup:max_ngram=4")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--max-new", type=int, default=128, help="new tokens per turn")
    ap.add_argument("--k", type=int, default=4, help="draft length per round")
    ap.add_argument("--out", required=True, help="results JSON; the Markdown table goes next to it (.md)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--target-path", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--limit", type=int, default=None, help="at most N prompts, round-robin over categories")
    ap.add_argument("--skip", type=int, default=0, help="skip the first N prompt records (e.g. those trained on)")
    ap.add_argument("--categories", default=None, help="comma list; 'mt_bench' = the 8 MT-bench categories")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="0 = the free CPUs of this process")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--save-tokens", action="store_true", help="keep every turn's output token ids in the JSON")
    ap.add_argument("--engine", choices=("auto", "reference", "runtime"), default="auto",
                    help="auto: the runtime (the reference loop for targets it does not cover)")
    return ap.parse_args(argv)


def run(args: argparse.Namespace, target=None, workers: Workers = Workers()) -> dict:
    """The benchmark; `target` (already loaded, e.g. by train.distill) is used when given; `workers` split the
    prompts over processes (see measure)."""
    from inference.sources import build_source, source_layer_ids
    from models.target import load_target

    check_args(args, CLI_RULES)
    check_writable(args.out, "--out")
    torch.set_num_threads(available_threads(args.threads))
    prompts = load_prompts(args.prompts, parse_categories(args.categories), args.limit, args.skip)
    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k)
    if target is None:
        target = load_target(args.target, path=args.target_path, layer_ids=source_layer_ids(args.source),
                             dtype=args.dtype)
    source = build_source(args.source, target)
    categories, turns = measure(target, source, prompts, args.k, sampling, args.max_new, args.seed,
                                not args.no_progress, args.save_tokens, args.engine, workers)
    return {
        "benchmark": "acceptance",
        "source": args.source,
        "prompts_file": str(args.prompts),
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "k": args.k,
        "max_new": args.max_new,
        "seed": args.seed,
        "engine": resolve_engine(args.engine, target),
        "target": target.fingerprint,
        "request": request(args),
        "overall": category_summary(sum(categories.values(), DecodeStats(k=args.k)), turns),
        "categories": {name: category_summary(stats, [t for t in turns if t["category"] == name])
                       for name, stats in categories.items()},
        "turns": turns,
    }


def request(args: argparse.Namespace) -> dict:
    """What a measurement depends on beyond the target: its settings and the files its source and prompts read (every
    file under a head's directory, a draft file, the prompts file: its sha256, or size and modification time over
    64 MiB, e.g. a large draft file). A saved result with the same request and target is the same measurement."""
    keys = ("source", "prompts", "categories", "limit", "skip", "k", "temperature", "top_p", "top_k", "max_new", "seed",
            "dtype", "engine", "target", "target_path")
    from inference.sources import source_paths

    files = {}
    for path in sorted(Path(p) for p in {*source_paths(args.source), args.prompts} if Path(p).exists()):
        for f in sorted([path] if path.is_file() else path.rglob("*")):
            if f.is_file():
                size = f.stat().st_size
                files[str(f)] = (hashlib.sha256(f.read_bytes()).hexdigest() if size <= 1 << 26
                                 else [size, f.stat().st_mtime_ns])
    return {**{k: getattr(args, k) for k in keys}, "files": files}


def saved_result(args: argparse.Namespace, target) -> dict | None:
    """The result already at --out when it is this request on this target (a rerun of the τ table skips it)."""
    try:
        saved = json.loads(Path(args.out).read_text())
    except (OSError, ValueError):
        return None
    same = saved.get("request") == request(args) and saved.get("target") == target.fingerprint
    return saved if same else None


def table(results: dict) -> str:
    rows = [{"category": name, **s} for name, s in results["categories"].items()]
    rows.append({"category": "**overall**", **results["overall"]})
    k = results["k"]
    for row in rows:
        for j, a in enumerate(row["acceptance"]):
            row[f"acc@{j + 1}"] = a
    # how many rounds each overall figure rests on: deep positions are tested in few rounds
    rows.append({"category": "rounds testing it", **{f"acc@{j + 1}": n for j, n in
                                                     enumerate(results["overall"].get("tested", []))}})
    columns = ["category", "prompts", "tokens", "rounds", "tau", "mean_draft_len"] + [f"acc@{j + 1}" for j in range(k)]
    return markdown_table(rows, columns)


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    results = run(args)
    md = table(results)
    title = (f"Acceptance: {results['source']} on {results['target']['name']}, T={results['temperature']}, "
             f"k={results['k']}, max_new={results['max_new']}")
    out, md_path = write_report(args.out, results, md, title)
    o = results["overall"]
    plot_tau_table([{"source": results["source"], "k": results["k"], "T": results["temperature"], "tau": o["tau"],
                     "acceptance": " ".join("-" if a is None else f"{a:.3f}" for a in o["acceptance"])}],
                   Path(args.out).with_suffix(".png"), title)
    print(md)
    overall = results["overall"]
    print(json.dumps({"benchmark": "acceptance", "source": results["source"], "temperature": results["temperature"],
                      "k": results["k"], "tau": overall["tau"], "mean_draft_len": overall["mean_draft_len"],
                      "acceptance": overall["acceptance"],
                      "tokens": overall["tokens"], "prompts": overall["prompts"], "out": str(out), "md": str(md_path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
