"""Training throughput and peak memory of a draft head, next to the dry-run plan's estimate for the same settings.

    python -m eval.train_bench --target smollm2-135m-instruct --steps 20 --batch 4 --length 512 --threads 2
    python -m eval.train_bench --target random-smollm2-shape --device cuda --mixed-precision bf16 --batch 8 --length 2048
    # FSDP2 / ZeRO / DDP: the same script under torchrun, with the strategy named
    python -m torch.distributed.run --standalone --nproc_per_node=1 -m eval.train_bench --device cuda --strategy fsdp

Features are the target's real hidden states on random token sequences of exactly --length tokens (every token a
loss token: the plan's bound). The steps run through the real trainer (train.trainer.train_draft); tokens/s is its
logged rate over the second half of the steps (the first half warms up). Peak memory: torch.cuda.max_memory_allocated
on a GPU, peak RSS of the process on the CPU (which includes Python, torch and the target). Prints ONE JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

from inference.host_memory import run_under_mimalloc

if __name__ == "__main__":
    run_under_mimalloc()  # the allocator train.distill runs under; before torch is imported (inference/host_memory.py)

import torch
from omegaconf import OmegaConf

from conf.schema import Config
from eval.machine import machine_info
from eval.speedup import RANDOM_TARGET, random_smollm2_shape
from models.errors import DraftheadsError, exit_on_error
from models.target import load_target


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct", help="a target name, tiny-random-llama, or "
                   f"{RANDOM_TARGET} (SmolLM2's shapes, random weights: for machines without the model)")
    p.add_argument("--target-path", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--family", default="peagle")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--draft-vocab", type=int, default=None)
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch and process")
    p.add_argument("--length", type=int, default=512, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    p.add_argument("--strategy", default="single", help="accelerate strategy when launched by torchrun")
    p.add_argument("--online", action="store_true", help="the target computes the hidden states in every step")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = p.parse_args(argv)
    for name in ("layers", "k", "batch", "length", "steps", "threads"):
        if getattr(args, name) < 1:
            raise DraftheadsError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    return args


def config(args) -> "OmegaConf":
    cfg = OmegaConf.structured(Config)
    cfg.name, cfg.target.name, cfg.runtime.device = "train_bench", args.target, args.device
    cfg.draft.family, cfg.draft.num_layers, cfg.draft.k = args.family, args.layers, args.k
    cfg.draft.parallel, cfg.draft.draft_vocab_size = args.family != "eagle3", args.draft_vocab
    cfg.data.max_length = args.length
    cfg.accelerate.strategy = args.strategy
    cfg.accelerate.num_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    for key, v in dict(steps=args.steps, batch_size=args.batch, mixed_precision=args.mixed_precision, warmup_steps=1,
                       log_every=max(1, args.steps // 2), checkpoint_every=10**9, eval_every=10**9).items():
        cfg.train[key] = v
    return cfg


def features(target, n: int, length: int, device, hidden: bool) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    items = []
    with torch.no_grad():
        for _ in range(n):
            ids = torch.randint(0, min(target.vocab_size, 32000), (length,), generator=g)
            items.append({"input_ids": ids, "loss_mask": torch.ones(length, dtype=torch.bool)})
            if hidden:
                out = target(ids[None].to(device))
                items[-1] |= {"aux_hidden": out.aux_hidden[0].float(), "final_hidden": out.final_hidden[0].float()}
    return items


def run(args) -> dict:
    from train.distributed import make_accelerator
    from train.plan import memory, sizes_of
    from train.trainer import _initial_head, train_draft

    torch.set_num_threads(args.threads)
    machine = machine_info()
    cfg = config(args)
    accelerator = make_accelerator(cfg.accelerate, cfg.train, args.device)
    device = str(accelerator.device)
    dtype = "bfloat16" if args.mixed_precision == "bf16" and args.device != "cpu" else "float32"
    target = random_smollm2_shape(dtype, device) if args.target == RANDOM_TARGET else \
        load_target(args.target, args.target_path, dtype=dtype, device=device)
    items = features(target, 2 * args.batch, args.length, device, hidden=not args.online)
    est = memory(sizes_of(target, _initial_head(cfg.draft, target, items)), cfg, args.strategy,
                 accelerator.num_processes, online=args.online, device="cuda" if args.device != "cpu" else "cpu")
    if args.device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    out = Path(args.out or tempfile.mkdtemp(prefix="train_bench_"))
    cfg.output_dir = str(out)
    t0 = time.perf_counter()
    train_draft(cfg, target, items, out, accelerator=accelerator)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if accelerator.is_main_process \
        else []
    peak = torch.cuda.max_memory_allocated() if args.device != "cpu" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"target": target.name, "device": device, "processes": accelerator.num_processes,
            "strategy": args.strategy, "online": args.online, "family": args.family, "layers": args.layers, "k": args.k,
            "batch": args.batch, "length": args.length, "steps": args.steps, "mixed_precision": args.mixed_precision,
            "threads": args.threads, "tokens_per_s": rows[-1]["tokens_per_s"] if rows else None,
            "final_loss": rows[-1]["loss"] if rows else None, "wall_s": round(wall, 1),
            "peak_memory_gib": round(peak / 2**30, 3), "peak_kind": "max_memory_allocated" if args.device != "cpu"
            else "process peak RSS", "plan_gib": {k: round(v / 2**30, 3) for k, v in est.items()},
            "plan_total_gib": round(sum(est.values()) / 2**30, 3),
            "other_load": os.environ.get("DRAFTHEADS_BENCH_NOTE", "not recorded"), "machine": machine}


def main(argv=None) -> None:
    result = run(parse_args(argv))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    exit_on_error(main)
