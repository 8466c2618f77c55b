"""Offline feature reads: random-read latency per sequence and training tokens/s, the row-mapped reader
(data.features.FeatureDataset: bounded shards, each read touching only its sequence's bytes) against the reader it
replaced (a whole shard loaded per access, one shard cached, 16384-token shards), on the same features.

    python -m eval.feature_bench --features outputs/s2/data/features --reads 300 --steps 30 --threads 2

The "before" layout is written once next to the features (DIR_legacy16k/), by reading every sequence and writing
16384-token shards as the old extractor did. Training runs the real trainer (P-EAGLE, the peagle_smollm2 settings)
from each reader for --steps steps; tokens/s is its logged rate over the second half. Prints ONE JSON line last.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from inference.host_memory import run_under_mimalloc

if __name__ == "__main__":
    run_under_mimalloc()  # the allocator train.distill runs under; before torch is imported (inference/host_memory.py)

import torch
from safetensors.torch import load_file

from data.features import MANIFEST, FeatureDataset, _write_shard
from models.errors import DraftheadsError, exit_on_error
from models.files import write_atomic

LEGACY_SHARD_TOKENS = 16384


class WholeShardDataset:
    """The replaced reader: ds[i] loads sequence i's whole shard (unless it is the one cached) and slices it."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.manifest = json.loads((directory / MANIFEST).read_text())
        self.index = [(s, j) for s, sh in enumerate(self.manifest["shards"]) for j in range(sh["sequences"])]
        self.cached: tuple[int, dict] | None = None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        s, j = self.index[i]
        if self.cached is None or self.cached[0] != s:
            self.cached = (s, load_file(str(self.dir / self.manifest["shards"][s]["file"])))
        t = self.cached[1]
        a, b = int(t["seq_offsets"][j]), int(t["seq_offsets"][j + 1])
        return {"input_ids": t["input_ids"][a:b].long(), "loss_mask": t["loss_mask"][a:b].bool(),
                "aux_hidden": t["aux_hidden"][a:b].float(), "final_hidden": t["final_hidden"][a:b].float()}


def legacy_copy(src: FeatureDataset, dst: Path) -> Path:
    """The same sequences in 16384-token shards (bfloat16), the layout the old extractor wrote."""
    if (dst / MANIFEST).is_file():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    manifest = {**src.manifest, "shards": [], "sequences_done": 0, "complete": False}
    buffer, tokens = [], 0
    for i in range(len(src)):
        item = src[i]
        buffer.append({"input_ids": item["input_ids"], "loss_mask": item["loss_mask"],
                       "aux_hidden": item["aux_hidden"].bfloat16(), "final_hidden": item["final_hidden"].bfloat16()})
        tokens += len(item["input_ids"])
        if tokens >= LEGACY_SHARD_TOKENS or i == len(src) - 1:
            _write_shard(dst, manifest, buffer, "", "shard")
            buffer, tokens = [], 0
    manifest["complete"] = True
    write_atomic(dst / MANIFEST, json.dumps(manifest, indent=1))
    return dst


def read_latency(ds, reads: int, seed: int = 0) -> dict:
    """ms per random sequence read (p50 / p90 / mean), with the OS page cache warm from a first pass."""
    rng = random.Random(seed)
    order = [rng.randrange(len(ds)) for _ in range(reads)]
    for i in order[: min(50, reads)]:
        ds[i]
    times = []
    for i in order:
        t0 = time.perf_counter()
        ds[i]
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"p50_ms": round(statistics.median(times), 3), "p90_ms": round(times[int(0.9 * len(times))], 3),
            "mean_ms": round(statistics.fmean(times), 3)}


def train_rate(ds, target, steps: int, threads: int) -> float:
    from omegaconf import OmegaConf

    from conf.schema import Config
    from train.trainer import train_draft

    cfg = OmegaConf.structured(Config)
    cfg.name, cfg.target.name = "feature_bench", target.name
    cfg.draft.k, cfg.draft.draft_vocab_size = 8, 8192
    for key, v in dict(steps=steps, batch_size=4, lr=1.5e-3, warmup_steps=2, log_every=max(1, steps // 2),
                       checkpoint_every=10**9).items():
        cfg.train[key] = v
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as out:
        cfg.output_dir = out
        train_draft(cfg, target, ds, out)
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["tokens_per_s"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", required=True, help="a feature directory with hidden states (data.features=offline)")
    ap.add_argument("--reads", type=int, default=300)
    ap.add_argument("--steps", type=int, default=30, help="training steps per reader; 0 = reads only")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from models.target import load_target

    new = FeatureDataset(args.features)
    if not new.hidden:
        raise DraftheadsError(f"'{args.features}' holds tokens only (an online run); pass offline features")
    old = WholeShardDataset(legacy_copy(new, Path(str(Path(args.features).resolve()) + "_legacy16k")))
    result = {"sequences": len(new), "shards": {"mapped": len(new.manifest["shards"]),
                                                "whole_shard_16k": len(old.manifest["shards"])},
              "read": {"mapped": read_latency(new, args.reads), "whole_shard_16k": read_latency(old, args.reads)},
              "threads": args.threads}
    if args.steps:
        fp = new.manifest["fingerprint"]
        target = load_target(fp["name"], layer_ids=fp["layer_ids"], parts="head_inputs")
        result["train_tokens_per_s"] = {"whole_shard_16k": train_rate(old, target, args.steps, args.threads),
                                        "mapped": train_rate(new, target, args.steps, args.threads)}
    print(json.dumps(result))


if __name__ == "__main__":
    exit_on_error(main)
