"""Regeneration: assistant turns re-written by the target, so the draft imitates the deployed model.

Decoding runs on the project's own runtime (inference/runtime.py: static KV cache, right-padded batches, plain
decoding, Llama-style targets) in `dtype`, bfloat16 by default: 292 vs 116 tok/s for HF `generate` in float32 on
SmolLM2, batch 16, 2 CPU threads (eval/regen_bench.py). The text is what the target deployed in that dtype writes;
greedy bf16 and fp32 continuations can part after a few dozen tokens.

Batched (prompts sorted by length to cut padding), seeded per batch, written to JSONL as each batch finishes and
resumed by skipping batches already on disk — a killed run loses at most one batch and, since batches are formed
the same way every time, the resumed file equals the uninterrupted one.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from data.chat import prompt_ids
from data.readers import Conversation
from inference.runtime import Runtime
from inference.sampling import SamplingConfig
from models.target import Target, _parse_dtype


def _user_turns(conv: Conversation, turns: int) -> tuple[list[dict], list[str]]:
    system = [t for t in conv[:1] if t["role"] == "system"]
    users = [t["content"] for t in conv if t["role"] == "user"][:turns]
    return system, users


def _read_done(path: Path) -> dict[int, dict]:
    """Finished records by id; a half-written last line (a kill mid-write) is dropped and rewritten."""
    done = {}
    if not path.exists():
        return done
    good = []
    for line in path.read_text(encoding="utf-8").split("\n"):  # not splitlines(): text may hold U+2028, U+0085
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        done[rec["id"]] = rec
        good.append(line)
    path.write_text("".join(l + "\n" for l in good), encoding="utf-8")
    return done


@torch.no_grad()
def regenerate(
    target: Target,
    conversations: list[Conversation],
    out_path: str | Path,
    max_new: int = 128,
    turns: int = 1,
    batch_size: int = 8,
    temperature: float = 0.0,
    seed: int = 0,
    max_prompt_tokens: int = 1024,
    dtype: str = "bfloat16",
) -> dict:
    """Write one JSONL record per conversation: {"id", "conversation", "finished": [bool per turn], "new_tokens"}.

    Returns counts and tokens/s. Prompts longer than max_prompt_tokens are skipped and counted.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    done = _read_done(out_path)
    items, skipped_long = [], 0
    for i, conv in enumerate(conversations):
        system, users = _user_turns(conv, turns)
        if not users:
            continue
        n_prompt = len(prompt_ids(tok, system + [{"role": "user", "content": users[0]}]))
        if n_prompt > max_prompt_tokens:
            skipped_long += 1
            continue
        items.append((n_prompt, i, system, users))
    items.sort(key=lambda x: (x[0], x[1]))
    decoder = _decoder(target, dtype)
    batches = [items[j : j + batch_size] for j in range(0, len(items), batch_size)]
    new_tokens, t0 = 0, time.perf_counter()
    with open(out_path, "a", encoding="utf-8") as f:
        for b, batch in enumerate(tqdm(batches, desc="regenerate", unit="batch")):
            if all(i in done for _, i, _, _ in batch):
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + b)
            chats = [list(system) for _, _, system, _ in batch]
            finished = [[] for _ in batch]
            for turn in range(turns):
                active = [j for j, (_, _, _, users) in enumerate(batch) if turn < len(users)]
                if not active:
                    break
                for j in active:
                    chats[j].append({"role": "user", "content": batch[j][3][turn]})
                texts, n_new = _generate(decoder, [chats[j] for j in active], max_new, temperature, gen)
                for j, (text, done_flag) in zip(active, texts):
                    chats[j].append({"role": "assistant", "content": text})
                    finished[j].append(done_flag)
                new_tokens += n_new
            for j, (_, i, _, _) in enumerate(batch):
                rec = {"id": i, "conversation": chats[j], "finished": finished[j]}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
    elapsed = time.perf_counter() - t0
    return {"records": len(items), "skipped_long_prompt": skipped_long, "new_tokens": new_tokens,
            "seconds": round(elapsed, 2), "tokens_per_s": round(new_tokens / max(elapsed, 1e-9), 1), "dtype": dtype}


def _decoder(target: Target, dtype: str) -> Target:
    """The target in the decoding dtype (a copy when it differs; features still come from the original)."""
    torch_dtype = _parse_dtype(dtype)
    if torch_dtype == target.dtype:
        return target
    return Target(copy.deepcopy(target.model).to(torch_dtype), target.tokenizer, target.name, target.layer_ids)


def _generate(target: Target, chats: list[Conversation], max_new: int, temperature: float,
              gen: torch.Generator) -> tuple[list[tuple[str, bool]], int]:
    """One batched pass of the runtime (plain decoding); returns (text, hit_eos) per chat and the tokens made."""
    tok = target.tokenizer
    prompts = [prompt_ids(tok, c) for c in chats]
    runtime = Runtime(target, max_len=max(len(p) for p in prompts) + max_new + 1, batch_size=len(prompts),
                      row_invariant=False)  # plain decoding only: nothing to be equal to
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    out = runtime.generate(prompts, max_new, sampling=SamplingConfig(temperature=temperature), seed=seed)
    results, n_new = [], 0
    for row in out.tokens:
        hit_eos = bool(row) and row[-1] in runtime.eos
        body = row[:-1] if hit_eos else row
        n_new += len(row)
        results.append((tok.decode(body, skip_special_tokens=True), hit_eos))
    return results, n_new
