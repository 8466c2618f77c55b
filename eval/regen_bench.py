"""Regeneration throughput: the runtime path data/regenerate.py uses (optionally vs HF `generate`), same prompts, greedy.

    python -m eval.regen_bench --threads 2                      # the default experiment's slice, as make demo runs it
    python -m eval.regen_bench --records 48 --batch 16 --hf     # against HF generate on the same records

The defaults are peagle_smollm2's data settings: the first 1200 ShareGPT records, prompts up to 384 tokens, 128 new
tokens, 64 rows per batch. Prints one JSON line last: new tokens/s for each path ("runtime_<dtype>", "hf_float32").
Run it alone: a second heavy torch process on 2 cores distorts both numbers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

from inference.host_memory import run_under_mimalloc

if __name__ == "__main__":
    run_under_mimalloc()  # the allocator train.distill runs under; before torch is imported (inference/host_memory.py)

import torch

from data.chat import prompt_ids
from data.readers import ReadStats, read_conversations
from data.regenerate import _user_turns, regenerate
from eval.machine import machine_info
from models.target import load_target


def hf_generate_tokens_per_s(target, convs, max_new: int, batch: int, max_prompt_tokens: int) -> float:
    """HF `generate` (left-padded batches sorted by length, as regeneration used before the runtime)."""
    tok = target.tokenizer
    prompts = [list(prompt_ids(tok, s + [{"role": "user", "content": u[0]}]))
               for s, u in (_user_turns(c, 1) for c in convs) if u]
    prompts = sorted((p for p in prompts if len(p) <= max_prompt_tokens), key=len)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    new, t0 = 0, time.perf_counter()
    for j in range(0, len(prompts), batch):
        group = prompts[j: j + batch]
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad)
        attn = torch.zeros_like(ids)
        for r, p in enumerate(group):
            ids[r, width - len(p):], attn[r, width - len(p):] = torch.tensor(p), 1
        out = target.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new, do_sample=False,
                                    pad_token_id=pad, eos_token_id=tok.eos_token_id)[:, width:]
        new += sum(next((k + 1 for k, t in enumerate(row) if t == tok.eos_token_id), len(row)) for row in out.tolist())
    return new / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.regen_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--dtype", default="bfloat16", help="the runtime's decoding dtype")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf", action="store_true", help="also time HF generate (float32) on the same records")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info()
    target = load_target()
    convs = list(itertools.islice(read_conversations("sharegpt", None, ReadStats()), args.records))
    with tempfile.TemporaryDirectory() as d:
        ours = regenerate(target, convs, Path(d) / "r.jsonl", max_new=args.max_new, batch_size=args.batch,
                          max_prompt_tokens=args.max_prompt_tokens, dtype=args.dtype)
    report = {"bench": "regen", "records": ours["records"], "batch": args.batch, "threads": args.threads,
              "max_new": args.max_new, "new_tokens": ours["new_tokens"], "seconds": ours["seconds"],
              f"runtime_{args.dtype}": ours["tokens_per_s"], "machine": machine}
    if args.hf:
        hf = hf_generate_tokens_per_s(target, convs, args.max_new, args.batch, args.max_prompt_tokens)
        report.update({"hf_float32": round(hf, 1), "ratio": round(ours["tokens_per_s"] / hf, 2)})
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    from models.errors import exit_on_error

    exit_on_error(main)
