"""The τ table at the end of a run (train.distill): every source at every K and temperature, on the general prompts
and a domain's, with the target already loaded, one JSON per row, before/after pairs for a fine-tune, PNG figures,
and the numbers a W&B sweep ranks by."""

from __future__ import annotations

import re
from pathlib import Path

from data.prepare import Workers
from inference.sources import PATH_SOURCES, path_and_options


def log_tau(wandb_run, rows: list[dict]) -> None:
    """τ of every row of the table into the W&B summary (tau/<source>_k<K>_T<T>), and `tau`: the trained head's at
    the first K and temperature, the number a temperature sweep ranks by."""
    for row in rows:
        if "tau" in row:
            wandb_run.summary[f"tau/{row['prompts']}/{row['source']}_k{row['k']}_T{row['T']:g}"] = row["tau"]
    head = [row for row in rows if row.get("source") == "head"]
    if head:
        wandb_run.summary["tau"] = head[0]["tau"]
        wandb_run.log({"tau": head[0]["tau"]})


def source_label(spec: str) -> str:
    """'head:DIR,tree=1' -> 'head[tree=1]': the source's name and options, without its path."""
    name, _, arg = spec.partition(":")
    options = path_and_options(arg)[1] if name in PATH_SOURCES else arg
    return f"{name}[{options}]" if options else name


def evaluate(cfg, sources: list[tuple[str, str]], out: Path, target, workers: Workers = Workers(),
             threads: int | None = None) -> list[dict]:
    """τ of every (label, source) at every K and temperature on the eval prompts (never trained on) and, when
    eval.domain_prompts is set, on those too, with the target already loaded (one load for every row); one table,
    one JSON per row under out/<prompt set>/. Several `workers` (processes, each with `threads` threads; default
    runtime.threads) split every row's prompts and get the same rows; the first writes the files. A fine-tune's rows
    pair head_before with head per prompt set, K and T: the τ difference with a 95% bootstrap interval over questions
    (eval.compare_tau) goes in a second table."""
    from eval import acceptance
    from eval.compare_tau import tau_difference
    from eval.plots import plot_tau_table
    from eval.report import markdown_table, write_report

    e = cfg.eval
    threads = cfg.runtime.threads if threads is None else threads
    suites = [(e.categories or Path(e.prompts).stem, e.prompts, e.categories, 0, e.limit)]
    if e.domain_prompts:
        name = Path(e.domain_prompts).stem
        suites.append((name if name != suites[0][0] else f"{name}_domain", e.domain_prompts, e.domain_categories,
                       e.domain_skip, e.domain_limit))  # its own directory when both sets read one file
    rows = []
    for suite, prompts, categories, skip, limit in suites:
        for label, source in sources:
            for k in e.k:
                for temperature in e.temperatures:
                    tag = re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") + f"_k{k}_T{temperature:g}"
                    args = acceptance.parse_args([
                        "--prompts", prompts, "--source", source, "--k", str(k), "--temperature", str(temperature),
                        "--max-new", str(e.max_new), "--out", str(out / suite / f"{tag}.json"),
                        "--target", cfg.target.name, "--dtype", cfg.target.dtype, "--threads",
                        str(threads), "--seed", str(cfg.train.seed), "--skip", str(skip),
                        *(["--target-path", cfg.target.path] if cfg.target.path else []),
                        *(["--limit", str(limit)] if limit else []),
                        *(["--categories", categories] if categories else [])])
                    results = acceptance.saved_result(args, target)  # a rerun (e.g. after a kill) keeps finished rows
                    if results is not None:
                        print(f"[draftheads] tau {label} k={k} T={temperature:g}: measured before ({args.out})")
                    else:
                        results = acceptance.run(args, target, workers)
                        if workers.rank == 0:
                            write_report(args.out, results, acceptance.table(results),
                                         f"{label}: {source}, k={k}, T={temperature:g}")
                    o = results["overall"]
                    rows.append({"prompts": suite, "source": label, "k": k, "T": temperature, "tau": o["tau"],
                                 "mean_draft_len": o["mean_draft_len"], "draft_ms": o["draft_ms_per_round"],
                                 "verify_ms": o["verify_ms_per_round"], "json": args.out,
                                 "acceptance": " ".join("-" if a is None else f"{a:.2f}" for a in o["acceptance"]),
                                 "tested": " ".join(map(str, o.get("tested", [])))})
    if workers.rank != 0:
        return rows
    md = markdown_table(rows, ["prompts", "source", "k", "T", "tau", "mean_draft_len", "draft_ms", "verify_ms",
                               "acceptance", "tested"])
    pairs = [(b, a) for b in rows for a in rows if b["source"] == "head_before" and a["source"] == "head"
             and (b["prompts"], b["k"], b["T"]) == (a["prompts"], a["k"], a["T"])]
    if pairs:
        changes = [{"prompts": b["prompts"], "k": b["k"], "T": b["T"], **tau_difference([(b["json"], a["json"])])}
                   for b, a in pairs]
        md += "\nBefore / after fine-tuning (95% bootstrap interval over questions):\n\n" + markdown_table(
            changes, ["prompts", "k", "T", "tau_before", "tau_after", "diff", "ci95", "questions"])
        rows.extend({"change": c} for c in changes)
    (out / "summary.md").write_text(md + "\n")
    for suite, *_ in suites:
        plot_tau_table([r for r in rows if r.get("prompts") == suite], out / f"summary_{suite}.png",
                       f"{cfg.target.name} on {suite}")
    print(f"\n[draftheads] tau ({', '.join(s[0] for s in suites)}, max_new {e.max_new}):\n{md}")
    return rows
