"""Offline features: the target's hidden states for every training token, in safetensors shards + a manifest.

A shard holds concatenated sequences: `input_ids` int32 [N], `loss_mask` uint8 [N], `seq_offsets` int64 [S+1],
`aux_hidden` bf16 [N, len(layer_ids)*H] (hidden states entering the configured layers) and `final_hidden` bf16
[N, H] (LM-head input: target logits for token t+1 = lm_head(final_hidden[t])). Storing the LM-head input instead
of logits costs H instead of V values per token (576 vs 49152 on SmolLM2).
The manifest is rewritten after every shard, so a killed run resumes after the last complete shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from inference.llama import LlamaForward
from models.errors import DraftheadsError
from models.target import Target

MANIFEST = "manifest.json"


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


@torch.no_grad()
def extract_features(
    target: Target,
    sequences: list[tuple[Tensor, Tensor]],  # (input_ids [T], loss_mask [T]) in a fixed order
    out_dir: str | Path,
    shard_tokens: int = 16384,
    batch_tokens: int = 4096,
) -> dict:
    """Run the target over every sequence and write shards; resumes from the manifest. Returns throughput stats."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mpath = out / MANIFEST
    manifest = json.loads(mpath.read_text()) if mpath.exists() else None
    if manifest is not None:
        target.check_fingerprint(manifest["fingerprint"], f"feature directory '{out}'", keys=(
            "vocab_size", "hidden_size", "tokenizer_hash", "layer_ids"))
    else:
        manifest = {"fingerprint": target.fingerprint, "layer_ids": list(target.layer_ids), "dtype": "bfloat16",
                    "shards": [], "sequences_done": 0, "complete": False}
    start = manifest["sequences_done"]
    digest = _sequences_digest(sequences[:start])
    recorded = manifest["shards"][-1].get("sha256") if manifest["shards"] else None  # older manifests: none
    if len(sequences) < start or recorded not in (None, digest.hexdigest()):
        raise DraftheadsError(f"feature directory '{out}' holds features of {start} sequences that are not the first "
                              f"{start} of the {len(sequences)} the data stage gives now (data.* settings or the "
                              "regenerated text changed); delete it or use a new output_dir")
    buffer: list[dict] = []
    buffered_tokens, new_tokens, t0 = 0, 0, time.perf_counter()
    todo = sequences[start:]
    bar = tqdm(total=sum(len(ids) for ids, _ in todo), desc="features", unit="tok")
    forward = _feature_forward(target)
    i = 0
    while i < len(todo):
        batch = [todo[i]]  # pack sequences up to batch_tokens (right padding), never far past a shard boundary
        while (i + len(batch) < len(todo)
               and (len(batch) + 1) * max(len(s[0]) for s in batch + [todo[i + len(batch)]]) <= batch_tokens
               and buffered_tokens + sum(len(s[0]) for s in batch) < shard_tokens):
            batch.append(todo[i + len(batch)])
        i += len(batch)
        for seq, (aux, final) in zip(batch, _run_batch(forward, [ids for ids, _ in batch])):
            buffer.append({"input_ids": seq[0], "loss_mask": seq[1], "aux_hidden": aux, "final_hidden": final})
            buffered_tokens += len(seq[0])
            new_tokens += len(seq[0])
            bar.update(len(seq[0]))
        if buffered_tokens >= shard_tokens or i == len(todo):
            for b in buffer:
                _digest_update(digest, b["input_ids"], b["loss_mask"])
            _write_shard(out, manifest, buffer, digest.hexdigest())
            buffer, buffered_tokens = [], 0
            _write_json_atomic(mpath, manifest)
    bar.close()
    manifest["complete"] = True
    _write_json_atomic(mpath, manifest)
    elapsed = time.perf_counter() - t0
    total_tokens = sum(s["tokens"] for s in manifest["shards"])
    total_bytes = sum((out / s["file"]).stat().st_size for s in manifest["shards"])
    return {"sequences": manifest["sequences_done"], "tokens": total_tokens, "new_tokens": new_tokens,
            "seconds": round(elapsed, 2), "tokens_per_s": round(new_tokens / max(elapsed, 1e-9), 1),
            "bytes": total_bytes, "bytes_per_token": round(total_bytes / max(total_tokens, 1), 1)}


def _sequences_digest(sequences) -> "hashlib._Hash":
    """SHA-256 over token ids and loss masks, in order: what the manifest's features were extracted from."""
    digest = hashlib.sha256()
    for ids, mask in sequences:
        _digest_update(digest, ids, mask)
    return digest


def _digest_update(digest, ids: Tensor, mask: Tensor) -> None:
    digest.update(ids.to(torch.int64).numpy().tobytes() + mask.to(torch.uint8).numpy().tobytes())


def _feature_forward(target: Target):
    """(ids [B, T], attention_mask [B, T]) -> TargetOutput without logits. On CPU, for Llama-style targets, the
    runtime's compact forward (float32 weights packed for oneDNN: HF's forward takes MKL's AVX2 path on this AMD CPU);
    right padding then needs no mask, since under causal attention no real token sees a pad. Otherwise HF's forward."""
    if target.device.type == "cpu":
        try:
            fwd = LlamaForward(target)
        except DraftheadsError:
            pass
        else:
            return lambda ids, attn: fwd(ids, fwd.new_cache(ids.shape[0], ids.shape[1]), compute_logits=False)
    return lambda ids, attn: target(ids.to(target.device), attention_mask=attn.to(target.device),
                                    compute_logits=False)


def _run_batch(forward, seqs: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, : len(s)], attn[r, : len(s)] = s, 1
    out = forward(ids, attn)
    return [(out.aux_hidden[r, : len(s)].to(torch.bfloat16).cpu(), out.final_hidden[r, : len(s)].to(torch.bfloat16).cpu())
            for r, s in enumerate(seqs)]


def _write_shard(out: Path, manifest: dict, buffer: list[dict], sha256: str) -> None:
    """sha256: digest of every sequence up to this shard's last (resume checks the data is the same)."""
    if not buffer:
        return
    lengths = torch.tensor([len(b["input_ids"]) for b in buffer])
    tensors = {
        "input_ids": torch.cat([b["input_ids"] for b in buffer]).to(torch.int32),
        "loss_mask": torch.cat([b["loss_mask"] for b in buffer]).to(torch.uint8),
        "seq_offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "aux_hidden": torch.cat([b["aux_hidden"] for b in buffer]),
        "final_hidden": torch.cat([b["final_hidden"] for b in buffer]),
    }
    name = f"shard_{len(manifest['shards']):05d}.safetensors"
    save_file(tensors, str(out / (name + ".tmp")))
    os.replace(out / (name + ".tmp"), out / name)
    manifest["shards"].append({"file": name, "sequences": len(buffer), "tokens": int(lengths.sum()), "sha256": sha256})
    manifest["sequences_done"] += len(buffer)


class FeatureDataset:
    """Sequences of a feature directory: ds[i] -> dict(input_ids [T] long, loss_mask [T] bool,
    aux_hidden [T, nH] float32, final_hidden [T, H] float32). Shards are loaded lazily, one at a time."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        mpath = self.dir / MANIFEST
        if not mpath.exists():
            raise DraftheadsError(f"'{self.dir}' is not a feature directory (no {MANIFEST}); run the data stage first")
        self.manifest = json.loads(mpath.read_text())
        if not self.manifest.get("complete"):
            raise DraftheadsError(f"feature directory '{self.dir}' is incomplete (a killed run?); rerun the same "
                                  "command to resume it")
        self.index = [(s, j) for s, shard in enumerate(self.manifest["shards"]) for j in range(shard["sequences"])]
        self._cache: tuple[int, dict] | None = None

    def __len__(self) -> int:
        return len(self.index)

    def _shard(self, s: int) -> dict:
        if self._cache is None or self._cache[0] != s:
            try:
                self._cache = (s, load_file(str(self.dir / self.manifest["shards"][s]["file"])))
            except Exception as e:
                raise DraftheadsError(f"feature shard '{self.manifest['shards'][s]['file']}' in '{self.dir}' cannot be "
                                      f"read ({e}); delete the directory and extract features again") from None
        return self._cache[1]

    def __getitem__(self, i: int) -> dict:
        s, j = self.index[i]
        t = self._shard(s)
        a, b = int(t["seq_offsets"][j]), int(t["seq_offsets"][j + 1])
        return {"input_ids": t["input_ids"][a:b].long(), "loss_mask": t["loss_mask"][a:b].bool(),
                "aux_hidden": t["aux_hidden"][a:b].float(), "final_hidden": t["final_hidden"][a:b].float()}
