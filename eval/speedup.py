"""Speedup benchmark: tokens/s of plain vs speculative decoding in the same runtime, plus HF baselines.

    python -m eval.speedup --target smollm2-135m-instruct --source prompt_lookup \
        --prompts eval/data/spec_bench_dev.jsonl --max-new 64 --temperature 0 --limit 8 --check-lossless

Rows: `plain` (our runtime, no source), `spec` (our runtime + source), `hf_generate` (transformers
`generate`, batch 1) and `hf_prompt_lookup` (`generate(prompt_lookup_num_tokens=K)`, batch 1). Every
request generates exactly --max-new tokens (EOS ignored), the first batch of each mode is a warm-up,
times are medians over --repeats (3; the modes' order alternates from batch to batch and repeat to repeat, so a
drift in machine speed favours none; each repeat's tokens/s is reported); tokens/s = new tokens / wall time
(prefill included). tau here is over first turns and runs through EOS (the τ tables stop at it and add second
turns): compare it with this table's own rows. Prompts are the
first user turn in the target's chat template; batches are formed inside a category. Also reported:
tau, acceptance per position, the cost of verifying n tokens vs 1 (profiled), KV-cache bytes.
--check-lossless (temperature 0) exits 1 if any speculative output differs from plain greedy.
Prints a per-category table, then ONE JSON line. Time on idle cores with the default OMP_WAIT_POLICY: PASSIVE (the
setting that keeps concurrent jobs from thrashing) made 2-thread bf16 decoding 1.5x slower here (the JSON records it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from data.chat import prompt_ids
from conf.schema import at_least, check_args
from eval.acceptance import CLI_RULES, load_prompts, parse_categories
from eval.machine import machine_info
from inference.runtime import Runtime
from inference.stats import DecodeStats
from inference.threads import CompetingLoad, available_threads
from inference.sampling import SamplingConfig
from inference.schedulers import ConfidencePrefix, DynamicK
from inference.sources import build_source, source_layer_ids
from models.errors import DraftheadsError, cli
from models.files import check_writable, write_atomic
from models.target import DEFAULT_TARGET, load_target

MODES = ("plain", "spec", "hf_generate", "hf_prompt_lookup")
RANDOM_TARGET = "random-smollm2-shape"  # SmolLM2-135M's shapes, random weights, byte tokenizer: timing only


def random_smollm2_shape(dtype: str, device: str):
    """For machines without the real weights (the GPU box): per-step costs are those of SmolLM2-135M,
    acceptance and outputs are not meaningful."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.target import Target, _parse_dtype
    from models.tiny_tokenizer import tiny_byte_tokenizer

    tok = tiny_byte_tokenizer()
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=_parse_dtype(dtype))
    return Target(model, tok, RANDOM_TARGET)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET, help=f"a target name/dir, or {RANDOM_TARGET} (timing only)")
    ap.add_argument("--target-path", default=None)
    ap.add_argument("--source", default="prompt_lookup",
                    help="build_source spec: prompt_lookup, draft_file:PATH, head:DIR")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--categories", default=None, help="comma list (alias mt_bench)")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--k", type=int, default=4, help="draft length (start value with --dynamic-k)")
    ap.add_argument("--dynamic-k", action="store_true", help="sliding-window K schedule (max --k-max)")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--prefix", action="store_true",
                    help="confidence prefix scheduler on the profiled verify cost (measured acceptance when the "
                         "source gives no confidences)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--skip", type=int, default=0, help="skip the first N prompt records (e.g. those trained on)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="0 = the free CPUs of this process (inference/threads.py)")
    ap.add_argument("--load", type=int, default=0, help="run N single-threaded busy processes beside the measurement")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cuda-graphs", action="store_true", help="CUDA: one captured graph per verify shape")
    ap.add_argument("--compile", action="store_true", help="CUDA: torch.compile(mode='reduce-overhead') instead")
    ap.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    ap.add_argument("--check-lossless", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here and a speedup-per-category PNG beside it")
    return ap.parse_args(argv)


def hf_generate(target, prompt: list[int], max_new: int, sampling: SamplingConfig, lookup_k: int | None, seed: int):
    ids = torch.tensor([prompt], device=target.device)
    # eos_token_id=[]: run through EOS like our runtime's ignore_eos (min_new_tokens would *suppress* EOS
    # and change the tokens, so outputs would stop being comparable after the first EOS)
    kwargs = dict(max_new_tokens=max_new, eos_token_id=[], attention_mask=torch.ones_like(ids),
                  pad_token_id=target.tokenizer.pad_token_id or 0)
    if sampling.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        # top_k=0 (not None, which means "the model's default", often 50) switches top-k off in HF
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    if lookup_k:
        kwargs["prompt_lookup_num_tokens"] = lookup_k
    torch.manual_seed(seed)
    out = target.model.generate(ids, **kwargs)
    return out[0, len(prompt):].tolist()


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - t0


def run(args: argparse.Namespace) -> tuple[dict, bool]:
    check_args(args, {**CLI_RULES, "k_max": at_least(1), "batch": at_least(1), "repeats": at_least(1),
                      "load": at_least(0)})
    if args.out:
        check_writable(args.out, "--out")
    with CompetingLoad(args.load):
        return _run(args)


def _run(args: argparse.Namespace) -> tuple[dict, bool]:
    args.threads = available_threads(args.threads)  # resolved after the load started: it sees the busy cores
    torch.set_num_threads(args.threads)
    machine = machine_info()  # as the benchmark sees it: under --load, the loaded machine
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise DraftheadsError(f"--modes {','.join(unknown)} unknown; pick from {','.join(MODES)}")
    if args.check_lossless and not {"plain", "spec"} <= set(modes):
        raise DraftheadsError(f"--check-lossless compares spec with plain outputs; --modes {args.modes} lacks one: add "
                              "plain,spec to --modes")
    if args.check_lossless and args.temperature > 0:
        raise DraftheadsError("--check-lossless compares with plain greedy decoding; use it with --temperature 0")
    target = random_smollm2_shape(args.dtype, args.device) if args.target == RANDOM_TARGET else \
        load_target(args.target, path=args.target_path, layer_ids=source_layer_ids(args.source), dtype=args.dtype,
                    device=args.device)
    # one source per batch slot: sources may keep per-request state (a head's draft KV cache)
    sources = [build_source(args.source, target) for _ in range(args.batch)]
    sampling = SamplingConfig(temperature=args.temperature)
    records = load_prompts(args.prompts, parse_categories(args.categories), args.limit, args.skip)
    tok = target.tokenizer
    prompts = [prompt_ids(tok, [{"role": "user", "content": r["turns"][0]}]).tolist() for r in records]

    by_cat = defaultdict(list)
    for r, p in zip(records, prompts):
        by_cat[r["category"]].append(p)
    batches = [(cat, ps[i:i + args.batch]) for cat, ps in by_cat.items() for i in range(0, len(ps), args.batch)]
    max_len = max(map(len, prompts)) + args.max_new + 2 * max(args.k, args.k_max) + 2
    rt = Runtime(target, max_len=max_len, batch_size=args.batch, cuda_graphs=args.cuda_graphs, compile=args.compile)
    # the group planner asks the cost of a whole group's tokens (up to batch x (1 + K)) and reads ~16+: measured, not
    # extrapolated, as far as a row of the cache holds them after some context
    widest = min(max(16, args.batch * (1 + (max(args.k, args.k_max) if args.dynamic_k else args.k))), max_len // 2)
    cost = rt.profile_cost(sizes=tuple(1 << i for i in range((widest - 1).bit_length() + 1)))
    schedule = (lambda: DynamicK(k=args.k, k_max=args.k_max)) if args.dynamic_k else None
    prefix = ConfidencePrefix(cost) if args.prefix else None

    def once(mode: str, batch: list[list[int]], stats: DecodeStats | None):
        if mode in ("plain", "spec"):
            source = sources[: len(batch)] if mode == "spec" else None
            g = rt.generate(batch, args.max_new, source=source, sampling=sampling,
                            k=args.k, schedule=schedule, prefix=prefix, seed=args.seed, ignore_eos=True)
            if stats is not None:
                stats += g.stats
            return g.tokens
        lookup = args.k if mode == "hf_prompt_lookup" else None
        return [hf_generate(target, p, args.max_new, sampling, lookup, args.seed) for p in batch]

    # warm-up at every batch size the timed runs meet (a category's last batch may be smaller): allocator, caches,
    # first-call overheads, CUDA graphs and compiled shapes are paid before the clock runs
    for batch in {len(b): b for _, b in batches}.values():
        for mode in modes:
            once(mode, batch, None)
    times = {m: defaultdict(list) for m in modes}  # mode -> batch index -> seconds per repeat
    outputs = {m: {} for m in modes}
    cat_stats = defaultdict(DecodeStats)
    for rep in range(args.repeats):
        for bi, (cat, batch) in enumerate(batches):
            for mode in (modes if (rep + bi) % 2 == 0 else modes[::-1]):
                st = cat_stats[cat] if (mode == "spec" and rep == 0) else None
                toks, sec = timed(lambda: once(mode, batch, st))
                times[mode][bi].append(sec)
                if rep == 0:
                    outputs[mode][bi] = toks
            print(f"[speedup] repeat {rep} batch {bi + 1}/{len(batches)} ({cat}) "
                  + " ".join(f"{m}={times[m][bi][-1]:.2f}s" for m in modes), file=sys.stderr)

    spec_stats = sum(cat_stats.values(), DecodeStats())
    n_tokens = [len(b) * args.max_new for _, b in batches]
    med = {m: [statistics.median(times[m][bi]) for bi in range(len(batches))] for m in modes}
    tps = {m: round(sum(n_tokens) / sum(med[m]), 2) for m in modes}
    tps_each = {m: [round(sum(n_tokens) / sum(times[m][bi][r] for bi in range(len(batches))), 2)
                    for r in range(args.repeats)] for m in modes}
    per_cat = {}
    for cat in by_cat:
        idx = [bi for bi, (c, _) in enumerate(batches) if c == cat]
        row = {m: round(sum(n_tokens[i] for i in idx) / sum(med[m][i] for i in idx), 2) for m in modes}
        if "spec" in modes and "plain" in modes:
            row["speedup"] = round(row["spec"] / row["plain"], 3)
        if cat in cat_stats:
            row["tau"] = round(cat_stats[cat].tau, 3)
        per_cat[cat] = row

    lossless, mismatches = None, []
    if "spec" in modes and "plain" in modes and sampling.greedy:
        for bi, (cat, _) in enumerate(batches):
            for j, (a, b) in enumerate(zip(outputs["spec"][bi], outputs["plain"][bi])):
                if a != b:
                    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    mismatches.append({"category": cat, "batch": bi, "request": j, "first_differing_token": first})
        lossless = not mismatches
    hf_match = None
    if "plain" in modes and "hf_generate" in modes and sampling.greedy:
        pairs = [(a, b) for bi in range(len(batches)) for a, b in zip(outputs["plain"][bi], outputs["hf_generate"][bi])]
        hf_match = round(sum(a == b for a, b in pairs) / len(pairs), 3)

    result = {
        "bench": "speedup", "target": args.target, "source": args.source, "dtype": args.dtype, "device": args.device,
        "temperature": args.temperature, "cuda_graphs": args.cuda_graphs, "compile": args.compile, "k": args.k,
        "dynamic_k": args.dynamic_k, "prefix": args.prefix, "batch": args.batch,
        "max_new": args.max_new, "prompts": len(prompts), "repeats": args.repeats, "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"), "competing_load": args.load,
        "machine": machine,
        "kv_cache_bytes": rt.kv_cache_bytes,
        "verify_ms": {n: round(s * 1000, 2) for n, s in zip(cost.sizes, cost.seconds)},
        "verify_cost_ratio_k": round(cost(args.k + 1) / cost(1), 3),
        "tokens_per_s": tps,
        "tokens_per_s_each_repeat": tps_each,
        "speedup": round(tps["spec"] / tps["plain"], 3) if {"spec", "plain"} <= set(tps) else None,
        "plain_vs_hf": round(tps["plain"] / tps["hf_generate"], 3) if {"plain", "hf_generate"} <= set(tps) else None,
        "tau": round(spec_stats.tau, 3) if spec_stats.rounds else None,
        **({k: v for k, v in spec_stats.summary().items() if k in ("acceptance", "accept_hist")}
           if spec_stats.rounds else {}),
        "per_category": per_cat, "lossless": lossless, "lossless_mismatches": mismatches,
        "plain_equals_hf_greedy": hf_match,
    }
    ok = not (args.check_lossless and lossless is False)
    return result, ok


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    result, ok = run(args)
    cols = [m for m in MODES if m in result["tokens_per_s"]] + ["speedup", "tau"]
    print("category".ljust(14) + "".join(c.rjust(18) for c in cols))
    for cat, row in result["per_category"].items():
        print(cat.ljust(14) + "".join(str(row.get(c, "-")).rjust(18) for c in cols))
    if not ok:
        print("error: speculative output differs from plain greedy decoding (not lossless)", file=sys.stderr)
    if args.out:
        from eval.plots import plot_speedup

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(args.out), json.dumps(result, indent=1))
        plot_speedup(result, Path(args.out).with_suffix(".png"))
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
