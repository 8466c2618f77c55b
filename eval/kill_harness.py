"""kill -9 at random moments across the whole pipeline, then compare with an uninterrupted run.

    python -m eval.kill_harness --kills 50 --out outputs/kill_harness      # ~10 min on 2 cores

One reference run of `train.distill +experiment=smoke` (tiny target: regeneration, features, soft labels, RL) runs
to the end. Then kill sequences start the same command in fresh directories and SIGKILL it at a random moment of a
randomly drawn stage (`kill_at`), again and again, until a launch survives; sequences repeat until --kills kills
happened. After each kill the harness notes how far the run had come (records, shards, checkpoints, heads on
disk). Every sequence's final regenerated records, feature shards and heads must equal the reference's (bitwise;
weights within 1e-6) and every metrics line must appear once. Prints ONE JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
RUN = ["+experiment=smoke", "data.max_records=24", "data.regen_batch_size=4", "train.steps=10",
       "train.checkpoint_every=2", "train.log_every=1", "train.stages=[soft_label,rl]", "train.rl_steps=4",
       "train.rl_max_context=512", "train.rl_anchors=4", "train.holdout_sequences=2", "train.eval_every=5",
       "eval.limit=0", "runtime.threads=1"]


def launch(out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "train.distill", *RUN, f"output_dir={out}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DRAFTHEADS_TEST_STEP_SLEEP": "0.05", "OMP_NUM_THREADS": "1"})


def progress(out: Path) -> str:
    """How far a killed run had come, from what it left on disk."""
    data = out / "data"
    if (out / "head" / "config.json").is_file():
        return "done"
    if (out / "checkpoints_rl").is_dir():
        return "rl"
    if (out / "head_soft_label" / "config.json").is_file():
        return "between stages"
    if (out / "checkpoints").is_dir() or (out / "metrics.jsonl").is_file():
        return "soft_label"
    if (data / "features").is_dir():
        return "features"
    if (data / "regenerated.jsonl").is_file():
        return "regeneration"
    return "startup"


def outputs(out: Path) -> dict:
    shards = sorted((out / "data" / "features").glob("shard_*.safetensors"))
    return {"records": (out / "data" / "regenerated.jsonl").read_bytes(),
            "features": [load_file(p) for p in shards],
            "heads": {h: load_file(out / h / "model.safetensors") for h in ("head_soft_label", "head")},
            "metrics": [(r["stage"], r["step"], "val_loss" in r or "val_expected_accepted" in r)
                        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]}


def same(a: dict, b: dict) -> tuple[bool, float]:
    """(equal, largest weight difference): records and shards bitwise, heads within 1e-6, metrics lines once each."""
    if a["records"] != b["records"] or len(a["features"]) != len(b["features"]) or a["metrics"] != b["metrics"]:
        return False, float("inf")
    for x, y in zip(a["features"], b["features"]):
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            return False, float("inf")
    worst = max(float((a["heads"][h][k].float() - b["heads"][h][k].float()).abs().max())
                for h in a["heads"] for k in a["heads"][h])
    return worst <= 1e-6, worst


PROGRESS = ("startup", "regeneration", "features", "soft_label", "between stages", "rl", "done")


def written_since(run_dir: Path, t0: float) -> bool:
    """Has the launched process itself written progress (records, shards, metrics, checkpoints, heads) yet?"""
    paths = [run_dir / "data" / "regenerated.jsonl", run_dir / "data" / "features" / "manifest.json",
             run_dir / "metrics.jsonl", run_dir / "head_soft_label" / "config.json", run_dir / "head" / "config.json",
             *run_dir.glob("checkpoints*/step_*")]
    return any(p.exists() and p.stat().st_mtime > t0 for p in paths)


def kill_at(proc: subprocess.Popen, run_dir: Path, stage: str, rng: random.Random, duration: float,
            launched: float) -> bool:
    """SIGKILL the run at a random moment of `stage` (the tiny target's stages last from 0.1 s to seconds, so a kill
    drawn uniformly over the run would rarely land in the short ones): wait until its files show that stage and the
    process has written something itself, then a random 0-0.5 s more; "startup" = uniformly over the reference's
    duration. A stage already behind the run is met at the run's next write. False when the run ended first."""
    deadline = time.perf_counter() + 3 * duration  # never wait forever (e.g. on a run that stalls)
    if stage != "startup":
        while proc.poll() is None and time.perf_counter() < deadline and not (
                PROGRESS.index(progress(run_dir)) >= PROGRESS.index(stage) and written_since(run_dir, launched)):
            time.sleep(0.01)
    try:
        proc.wait(timeout=rng.uniform(0.0, duration if stage == "startup" else 0.5))
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


def run_harness(kills: int, out: Path, seed: int = 0) -> dict:
    rng = random.Random(seed)
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    ref = launch(out / "reference")
    err = ref.communicate()[1]
    if ref.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{err[-2000:]}")
    duration = time.perf_counter() - t0
    reference = outputs(out / "reference")
    where, sequences, done = Counter(), [], 0
    while done < kills:
        run_dir = out / f"killed_{len(sequences)}"
        launches = 0
        while True:
            launches += 1
            finished = progress(run_dir) == "done"  # a rerun of a finished directory only rewrites its report
            launched = time.time()
            proc = launch(run_dir)
            if not finished and kill_at(proc, run_dir, rng.choice(PROGRESS), rng, duration, launched):
                done += 1
                where[progress(run_dir)] += 1
                continue
            err = proc.communicate()[1]
            if proc.returncode != 0:
                raise SystemExit(f"a resumed run failed in {run_dir}:\n{err[-2000:]}")
            break
        equal, worst = same(reference, outputs(run_dir))
        sequences.append({"dir": str(run_dir), "launches": launches, "equal": equal, "max_weight_diff": worst})
        if not equal:
            break
    return {"benchmark": "kill_harness", "kills": done, "sequences": len(sequences),
            "all_equal": all(s["equal"] for s in sequences), "kills_by_progress": dict(where),
            "reference_seconds": round(duration, 1), "max_weight_diff": max(s["max_weight_diff"] for s in sequences),
            "details": sequences}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--out", default="outputs/kill_harness")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    result = run_harness(args.kills, Path(args.out), args.seed)
    print(json.dumps(result))
    return 0 if result["all_equal"] else 1


if __name__ == "__main__":
    from models.errors import exit_on_error

    exit_on_error(main)
