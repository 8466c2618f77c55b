"""Hostile inputs replayed through the commands a user runs, tabulated by outcome (the reliability issue's table).

    python -m eval.probe_table --out outputs/probes        # ~10 min on 2 cores; prints ONE JSON line last

One finished tiny-target run (`+experiment=smoke`) is made first; every case damages a fresh copy of it (or passes a
bad flag) and runs `train.distill`, `eval.acceptance`, `eval.speedup` or `data.draft_file` on it. Outcomes:
  clear error  non-zero exit, no traceback, the last line names the problem (and, for run directories, nothing lost)
  correct      exit 0 and the case's check holds (the input was repaired or is legal)
  traceback    a Python traceback reached the user
  silent       exit 0 where the input should have been refused, or the check failed (data lost or duplicated)
The damage recipes are shared with tests/test_probes.py; the tests assert the exact messages.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = "eval/data/spec_bench_dev.jsonl"
TINY = "tiny-random-llama"
RUN = ["+experiment=smoke", "data.max_records=8", "train.checkpoint_every=2", "eval.limit=0", "runtime.threads=1"]


def cut(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def no_heads(d: Path) -> None:
    """As if killed before the heads were saved: training reruns from the checkpoints (train.steps is raised to 6)."""
    shutil.rmtree(d / "head")
    shutil.rmtree(d / "head_soft_label")


def killed_in_regeneration(d: Path) -> None:
    """As if killed while regenerating: only the records exist."""
    for name in ("head", "head_soft_label", "checkpoints", "data/features"):
        shutil.rmtree(d / name, ignore_errors=True)
    for name in ("metrics.jsonl", "data/data_report.json", "run_report.json"):
        (d / name).unlink(missing_ok=True)


def edit_head_config(d: Path, change: Callable[[dict], dict]) -> None:
    path = d / "head" / "config.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def nan_in_shard(d: Path) -> None:
    """Bit flips that leave a loadable shard whose hidden states are NaN (bf16 0xFFFF)."""
    path = d / "data" / "features" / "shard_00000.safetensors"
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    data[start:start + 4096] = b"\xff" * 4096
    path.write_bytes(bytes(data))
    killed_after_features(d)


def killed_after_features(d: Path) -> None:
    for name in ("head", "head_soft_label", "checkpoints"):
        shutil.rmtree(d / name, ignore_errors=True)
    (d / "metrics.jsonl").unlink(missing_ok=True)


def wrong_shapes(d: Path) -> None:
    from safetensors.torch import load_file

    from models.files import save_tensors

    path = d / "head" / "model.safetensors"
    tensors = load_file(path)
    name = next(k for k, v in tensors.items() if v.dim() == 2)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_tensors(path, tensors)


HEAD_DAMAGE = {  # name: (damage, what the error names)
    "config truncated": (lambda d: cut(d / "head" / "config.json"), "config.json' is not valid JSON"),
    "config empty": (lambda d: cut(d / "head" / "config.json", 0), "config.json' is not valid JSON"),
    "config without target": (lambda d: edit_head_config(d, lambda c: {k: v for k, v in c.items() if k != "target"}),
                              "lacks ['target']"),
    "weights truncated": (lambda d: cut(d / "head" / "model.safetensors"), "model.safetensors' cannot be read"),
    "weights empty": (lambda d: cut(d / "head" / "model.safetensors", 0), "model.safetensors' cannot be read"),
    "weights garbage": (lambda d: (d / "head" / "model.safetensors").write_bytes(os.urandom(5000)), "cannot be read"),
    "a file, not a directory": (lambda d: (shutil.rmtree(d / "head"), (d / "head").write_text("x")),
                                "is not a draft checkpoint"),
}
RUN_DAMAGE = {  # damage to a run directory that a resume must name: (damage, what the error names)
    "checkpoint weights truncated": (lambda d: cut(d / "checkpoints" / "step_4" / "model.safetensors"),
                                     "checkpoints/step_4' cannot be read"),
    "optimizer truncated": (lambda d: cut(d / "checkpoints" / "step_4" / "optimizer.bin"),
                            "checkpoints/step_4' cannot be read"),
    "checkpoint random states missing": (lambda d: (d / "checkpoints" / "step_4" / "random_states_0.pkl").unlink(),
                                         "checkpoints/step_4' is incomplete ('random_states_0.pkl' is missing)"),
    "feature manifest damaged": (lambda d: cut(d / "data" / "features" / "manifest.json"), "manifest.json' is damaged"),
    "feature shard missing": (lambda d: (d / "data" / "features" / "shard_00000.safetensors").unlink(),
                              "shard_00000.safetensors' cannot be read"),
    "feature shard damaged": (lambda d: cut(d / "data" / "features" / "shard_00000.safetensors"),
                              "shard_00000.safetensors' cannot be read"),
    "record without id": (lambda d: (d / "data" / "regenerated.jsonl").write_text(
        (d / "data" / "regenerated.jsonl").read_text().replace('"id": 0,', "", 1)), "is not a regenerated record"),
}
RECOVERS = {  # damage a resume repairs by itself, to the same head
    "empty checkpoint marker": lambda d: cut(d / "checkpoints" / "step_4" / "trainer_state.json", 0),
    "torn metrics line": lambda d: cut(d / "metrics.jsonl", len((d / "metrics.jsonl").read_bytes()) - 7),
    "damaged data report": lambda d: cut(d / "data" / "data_report.json"),
}


@dataclass
class Case:
    group: str  # the heading
    name: str
    argv: Callable[[Path], list[str]]  # the command, given the damaged run directory
    damage: Callable[[Path], object] | None = None
    check: Callable[[Path, Path], bool] | None = None  # (run, base) -> the result is right; None = must refuse


def distill(*overrides: str, out: str = ".") -> Callable[[Path], list[str]]:
    return lambda d: ["-m", "train.distill", *RUN, "train.steps=4", f"output_dir={d / out}", *overrides]


def resume(*overrides: str) -> Callable[[Path], list[str]]:
    return lambda d: ["-m", "train.distill", *RUN, "train.steps=6", f"output_dir={d}", *overrides]


def acceptance(*flags: str) -> Callable[[Path], list[str]]:
    return lambda d: ["-m", "eval.acceptance", "--prompts", PROMPTS, "--source", "prompt_lookup", "--target", TINY,
                      "--limit", "1", "--max-new", "4", "--out", str(d / "acc.json"), *flags]


def head_acceptance(d: Path) -> list[str]:
    return acceptance("--source", f"head:{d}/head")(d)


def speedup(*flags: str) -> Callable[[Path], list[str]]:
    return lambda d: ["-m", "eval.speedup", "--prompts", PROMPTS, "--target", TINY, "--limit", "1", "--max-new", "4",
                      "--modes", "plain", *flags]


def records(d: Path) -> list[str]:
    return (d / "data" / "regenerated.jsonl").read_text().splitlines()


def same_records(d: Path, base: Path) -> bool:
    return records(d) == records(base)


def finished_once(d: Path, base: Path) -> bool:
    lines = (d / "metrics.jsonl").read_text().splitlines()
    steps = [(r["stage"], r["step"], "val_loss" in r) for r in map(json.loads, lines)]
    return len(steps) == len(set(steps)) and (d / "head" / "config.json").is_file() and same_records(d, base)


def same_head(d: Path, base: Path) -> bool:
    return finished_once(d, base) and (d / "head" / "model.safetensors").read_bytes() == (
        base / "head" / "model.safetensors").read_bytes()


def more_records_once(d: Path, base: Path) -> bool:
    """The earlier records kept as they were, the new ones appended once (prompts too long are skipped)."""
    ids, n = [json.loads(x)["id"] for x in records(d)], len(records(base))
    return len(ids) == len(set(ids)) > n and records(d)[:n] == records(base) and min(ids[n:]) >= 8


def write_bad_utf8(d: Path) -> Path:
    path = d / "bad.jsonl"
    path.write_bytes(b'{"conversations": [{"from": "human", "value": "caf\xe9 \xff"}]}\n')
    return path


def utf8_corpus(d: Path) -> Path:
    (d / "corpus").mkdir()
    for i in range(20):  # one file with bytes that are not UTF-8 among valid ones
        body = b"def f%d():\n    return '%s caf\xc3\xa9'\n" % (i, b"\xff\xfe" if i == 3 else b"ok")
        (d / "corpus" / f"m{i}.py").write_bytes(body * 50)
    return d / "corpus"


def in_a_file(d: Path) -> Path:
    (d / "file").write_text("")
    return d / "file" / "x"


def bad(flag_group: str, maker, *flags: str, fresh: bool = False) -> Case:
    return Case(flag_group, " ".join(flags), maker(*flags, **({"out": "fresh"} if fresh else {})))


CASES = [
    # data lost or duplicated
    Case("lost or duplicated", "resume rewrites no record", resume(), no_heads,
         lambda d, b: same_records(d, b) and (d / "data" / "regenerated.jsonl").stat().st_mtime_ns == (
             b / "data" / "regenerated.jsonl").stat().st_mtime_ns),
    Case("lost or duplicated", "records cut 30 bytes before the end", distill(),
         lambda d: (cut(d / "data" / "regenerated.jsonl", len((d / "data" / "regenerated.jsonl").read_bytes()) - 30),
                    killed_in_regeneration(d)), same_head),
    Case("lost or duplicated", "data.max_records raised on a finished run", distill("data.max_records=10"), None,
         more_records_once),
    Case("lost or duplicated", "empty checkpoint marker", resume(), lambda d: (no_heads(d), RECOVERS[
        "empty checkpoint marker"](d)), finished_once),
    Case("lost or duplicated", "empty best.json", resume("train.eval_every=2"),
         lambda d: (no_heads(d), (d / "checkpoints" / "best").mkdir(), (d / "checkpoints" / "best" / "best.json")
                    .write_text("")), finished_once),
    # silently wrong results
    *(bad("silently wrong", distill, o, fresh=True) for o in (
        "draft.k=0", "draft.k=-1", "train.steps=0", "train.steps=-5", "train.grad_accum=0", "train.rl_steps=-3",
        "data.overlong=explode", "data.regen_max_new=0")),
    Case("silently wrong", "NaN bytes in a feature shard", distill(), nan_in_shard),
    *(bad("silently wrong", acceptance, *f) for f in (
        ("--temperature", "-1"), ("--temperature", "inf"), ("--top-p", "2"), ("--top-k", "-5"), ("--limit", "-1"))),
    bad("silently wrong", speedup, "--k", "0"),
    Case("silently wrong", "draft.k changed on resume", resume("draft.k=3"), no_heads),
    Case("silently wrong", "draft family changed on resume", resume("draft=eagle3"), no_heads),
    Case("silently wrong", "data.max_records lowered", distill("data.max_records=6")),
    # tracebacks before
    Case("traceback before", "invalid UTF-8 in a data file",
         lambda d: distill("data.source=sharegpt", f"data.path={write_bad_utf8(d)}", out="fresh")(d)),
    Case("traceback before", "invalid UTF-8 in a prompts file",
         lambda d: acceptance("--prompts", str(write_bad_utf8(d)))(d)),
    Case("traceback before", "invalid UTF-8 in a corpus file",
         lambda d: ["-m", "data.draft_file", "build", "--corpus", str(utf8_corpus(d)), "--target", TINY, "--out",
                    str(d / "c.dfl")], None, lambda d, b: (d / "c.dfl").is_file()),
    Case("traceback before", "a directory as the prompts file", lambda d: acceptance("--prompts", str(d))(d)),
    Case("traceback before", "a directory as the data file",
         lambda d: distill("data.source=chat_jsonl", f"data.path={d}", out="fresh")(d)),
    *(Case("traceback before", f"head: {n}", head_acceptance, dmg) for n, (dmg, _) in HEAD_DAMAGE.items()),
    Case("traceback before", "head: weights of the wrong shape", head_acceptance, wrong_shapes),
    *(Case("traceback before", f"run: {n}", resume(*(["data.max_records=9"] if n == "record without id" else [])),
           lambda d, dmg=dmg: (no_heads(d), dmg(d))) for n, (dmg, _) in RUN_DAMAGE.items()),
    *(Case("traceback before", f"run: {n}", resume(), lambda d, r=r: (no_heads(d), r(d)), finished_once)
      for n, r in RECOVERS.items() if n != "empty checkpoint marker"),
    *(bad("traceback before", distill, o, fresh=True) for o in (
        "train.checkpoint_every=0", "train.log_every=0", "train.eval_every=0", "train.batch_size=0",
        "train.batch_size=-1", "train.lr=-1", "runtime.device=cuda", "train.mixed_precision=fp8")),
    Case("traceback before", "runtime.threads=0 (auto)", distill("runtime.threads=0"), None, finished_once),
    *(bad("traceback before", acceptance, *f) for f in (("--temperature", "nan"), ("--top-p", "0"))),
    Case("traceback before", "--threads 0 (auto)", acceptance("--threads", "0"), None,
         lambda d, b: (d / "acc.json").is_file()),
    *(bad("traceback before", speedup, *f) for f in (("--batch", "0"), ("--repeats", "0"), ("--max-new", "0"))),
    Case("traceback before", "output_dir not writable", lambda d: distill(out=str(in_a_file(d)))(d)),
    Case("traceback before", "eval.acceptance --out not writable", lambda d: acceptance("--out", str(in_a_file(d)))(d)),
    Case("traceback before", "eval.speedup --out not writable", lambda d: speedup("--out", str(in_a_file(d)))(d)),
    Case("traceback before", "draft_file --out not writable",
         lambda d: ["-m", "data.draft_file", "build", "--corpus", PROMPTS, "--target", TINY, "--out",
                    str(in_a_file(d))]),
]


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def outcome(r: subprocess.CompletedProcess, ok: bool | None) -> str:
    if "Traceback (most recent call last)" in r.stderr:
        return "traceback"
    if r.returncode == 0:
        return "correct" if ok else "silent"
    last = (r.stderr.strip().splitlines() or [""])[-1]
    return "clear error" if last.lower().startswith("error") and ok is not False else "unclear error"


def run_case(case: Case, base: Path, work: Path) -> dict:
    d = work / "run"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, d, symlinks=True)
    if case.damage:
        case.damage(d)
    kept = records(d)
    r = subprocess.run([sys.executable, *case.argv(d)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    ok = case.check(d, base) if case.check and r.returncode == 0 else None
    if r.returncode != 0 and (d / "data" / "regenerated.jsonl").is_file():  # a refusal loses and adds nothing
        ok = records(d) == kept or bool(case.check and case.check(d, base))
    last = (r.stderr.strip().splitlines() or [""])[-1]
    return {"group": case.group, "case": case.name, "outcome": outcome(r, ok), "exit": r.returncode, "last": last[:300]}


def disk_full_cases(work: Path) -> list[dict]:
    rows = []
    for size in ("400k", "560k", "900k"):
        disk = work / f"disk_{size}"
        if not mount_tmpfs(disk, size):
            return [{"group": "traceback before", "case": "disk full", "outcome": "skipped (needs root)", "exit": None,
                     "last": ""}]
        try:
            argv = [sys.executable, *distill(out="run")(disk)]
            r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
            again = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
            row = {"group": "traceback before", "case": f"disk full at {size}", "exit": r.returncode,
                   "last": (r.stderr.strip().splitlines() or [""])[-1][:300]}
            row["outcome"] = outcome(r, again.returncode == 0) if r.returncode else "silent"
            rows.append(row)
        finally:
            subprocess.run(["umount", str(disk)], capture_output=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/probes")
    p.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="probes_"))
    base = work / "base"
    r = subprocess.run([sys.executable, *distill()(base)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if r.returncode:
        sys.exit(f"error: the base run failed:\n{r.stderr[-2000:]}")
    rows = []
    for case in CASES:
        if args.only is None or args.only in case.name:
            rows.append(run_case(case, base, work / "case"))
            row = rows[-1]
            print(f"{row['outcome']:>13}  {case.group:<18} {case.name}"
                  f"{'' if row['outcome'] == 'correct' else ': ' + row['last'][:160]}", flush=True)
    if args.only is None:
        rows += disk_full_cases(work)
    shutil.rmtree(work, ignore_errors=True)
    (out / "probes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    table = Counter((x["group"], x["outcome"]) for x in rows)
    summary = {"cases": len(rows), "by_outcome": dict(Counter(x["outcome"] for x in rows)),
               "by_group": {f"{g} / {o}": n for (g, o), n in sorted(table.items())}}
    print(json.dumps(summary))
    return 0 if all(x["outcome"] in ("clear error", "correct") for x in rows) else 1


if __name__ == "__main__":
    from models.errors import exit_on_error

    exit_on_error(main)
