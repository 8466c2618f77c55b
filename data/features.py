"""Training sequences on disk: token ids, loss masks and (offline) the target's hidden states, in bounded shards.

A shard (safetensors) holds concatenated sequences: `input_ids` int32 [N], `loss_mask` uint8 [N], `seq_offsets`
int64 [S+1] and, for offline features, `aux_hidden` [N, n*H] (hidden states entering the n configured layers) and
`final_hidden` [N, H] (the LM-head input: target logits for token t+1 = lm_head(final_hidden[t])) and `target_argmax`
int32 [N] (the target's greedy next token over its whole vocabulary: what draft agreement is measured against, also
for heads with a reduced draft vocabulary). Storing the LM-head input instead of logits costs H instead of V values
per token (576 vs 49152 on SmolLM2). Hidden states are bfloat16,
or int8 with one float32 scale per token and layer (`aux_scale` [N, n], `final_scale` [N, 1]; data.feature_dtype=int8).
Online runs (data.features=online) store tokens only: the target recomputes hidden states in the training step,
rounded exactly as storage would round them (`round_like_storage`), so online and offline train on the same numbers.

Shards close at ~shard_tokens tokens (prepare_data sizes them from data.shard_mb); a batch reads only its rows,
through memory maps (safetensors slices). Extraction can be split over W ranks: rank r extracts a contiguous block of
the sequences into `part_r` files; the main process merges the parts' shard lists into manifest.json in order.
Every manifest is replaced atomically after each shard, so a killed run resumes after its last complete shard.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor
from tqdm import tqdm

from inference.sampling import greedy_tokens
from models.errors import DraftheadsError
from models.files import save_tensors, write_atomic
from models.target import Target

MANIFEST = "manifest.json"
FEATURE_DTYPES = ("bfloat16", "int8")


def part_block(n: int, rank: int, world: int) -> tuple[int, int]:
    """Sequences [lo, hi) that rank `rank` of `world` extracts: contiguous blocks, so parts concatenate in order."""
    return n * rank // world, n * (rank + 1) // world


@torch.no_grad()
def extract_features(target: Target, sequences: list[tuple[Tensor, Tensor]], out_dir: str | Path,
                     shard_tokens: int = 16384, batch_tokens: int = 4096, hidden: bool = True,
                     dtype: str = "bfloat16", rank: int = 0, world: int = 1, weights: dict | None = None) -> dict:
    """Write this rank's block of `sequences` ((input_ids [T], loss_mask [T]) in a fixed order), with the target's
    hidden states when `hidden`; resumes from the part's manifest when it holds the same target (by name and
    `weights`, data.prepare.weights_identity, for hidden states; by tokenizer for tokens). With world > 1 the caller waits for every rank and
    has the main process call merge_parts. Returns throughput stats of this rank."""
    if dtype not in FEATURE_DTYPES:
        raise DraftheadsError(f"data.feature_dtype '{dtype}' is not one of {list(FEATURE_DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lo, hi = part_block(len(sequences), rank, world)
    name = MANIFEST if world == 1 else f"part_{rank}-of-{world}.json"
    mpath = out / name
    manifest = _read_manifest(mpath) if mpath.exists() else None
    if manifest is not None:
        target.check_fingerprint(manifest["fingerprint"], f"feature directory '{out}'", keys=(
            "vocab_size", "hidden_size", "tokenizer_hash", "layer_ids"))
        stored = manifest.get("hidden", True)  # a tokens-only directory stores no dtype-bound states
        if stored != hidden or (hidden and manifest.get("dtype", "bfloat16") != dtype):
            raise DraftheadsError(f"feature directory '{out}' holds {_kind(manifest)}; this run asks for "
                                  f"{_kind({'hidden': hidden, 'dtype': dtype})}. Use another output_dir")
        was = (manifest["fingerprint"].get("name"), manifest.get("target_weights", weights or {}))  # older: unrecorded
        if hidden and was != (target.name, weights or {}):
            raise DraftheadsError(f"feature directory '{out}' holds hidden states of target '{was[0]}' loaded with "
                                  f"{was[1] or 'its built-in weights'}; this run loads '{target.name}' with "
                                  f"{weights or 'its built-in weights'}. Use another output_dir (or data.cache_dir, "
                                  "which keeps one directory per target)")
    else:
        manifest = {"fingerprint": target.fingerprint, "layer_ids": list(target.layer_ids), "hidden": hidden,
                    "dtype": dtype, "shards": [], "sequences_done": 0, "complete": False,
                    "target_weights": weights or {}}
    mine = sequences[lo:hi]
    start = manifest["sequences_done"]
    if manifest.get("parts", 1) > 1 and world == 1:  # merged from W ranks: each part checked against its block
        return _check_merged(out, manifest, sequences)
    digest = _sequences_digest(mine[:start])
    recorded = manifest["shards"][-1].get("sha256") if manifest["shards"] else None  # older manifests: none
    if len(mine) < start or recorded not in (None, digest.hexdigest()):
        if manifest.get("first", lo) == lo:  # this block, other sequences
            raise _changed(out, start, len(mine))
        # more (or fewer) sequences moved the start of this rank's block: its part is made again, over shard files
        # the merged manifest lists, so that manifest goes first (merge_parts writes the new one)
        (out / MANIFEST).unlink(missing_ok=True)
        manifest.update(shards=[], sequences_done=0, complete=False)
        start, digest = 0, _sequences_digest([])
    manifest["first"] = lo
    prefix = "shard" if world == 1 else f"shard_r{rank}-of-{world}"
    todo = mine[start:]
    if todo:  # an extension (more records) is incomplete until its last shard: a kill must not leave "complete"
        manifest["complete"] = False
    new_tokens, t0 = 0, time.perf_counter()
    tokens_todo = sum(len(ids) for ids, _ in todo)
    _check_space(out, tokens_todo * _bytes_per_token(target, hidden, dtype))
    with tqdm(total=tokens_todo, desc="features" if world == 1 else f"features[{rank}]", unit="tok",
              position=rank) as bar:
        forward = _feature_forward(target) if hidden else None
        i = 0
        while i < len(todo):
            n, size = 0, 0  # the next shard: sequences in order up to shard_tokens
            while i + n < len(todo) and (n == 0 or size < shard_tokens):
                size += len(todo[i + n][0])
                n += 1
            shard, i = todo[i: i + n], i + n
            stored: list[dict] = [{} for _ in shard]  # each row's encoded states, filled batch by batch
            for batch in _length_sorted_batches([len(ids) for ids, _ in shard], batch_tokens) if hidden else []:
                for j, (aux, final, argmax) in zip(batch, _run_batch(forward, target, [shard[j][0] for j in batch])):
                    stored[j] = {**encode(aux.cpu(), final.cpu(), dtype), "target_argmax": argmax.cpu()}
                bar.update(sum(len(shard[j][0]) for j in batch))
            if not hidden:
                bar.update(size)
            buffer = [{"input_ids": ids, "loss_mask": mask, **st} for (ids, mask), st in zip(shard, stored)]
            new_tokens += size
            for b in buffer:
                _digest_update(digest, b["input_ids"], b["loss_mask"])
            _write_shard(out, manifest, buffer, digest.hexdigest(), prefix)
            write_atomic(mpath, json.dumps(manifest, indent=1))
    manifest["complete"] = True
    write_atomic(mpath, json.dumps(manifest, indent=1))
    elapsed = time.perf_counter() - t0
    tokens = sum(s["tokens"] for s in manifest["shards"])
    size = sum((out / s["file"]).stat().st_size for s in manifest["shards"])
    return {"sequences": manifest["sequences_done"], "tokens": tokens, "new_tokens": new_tokens,
            "seconds": round(elapsed, 2), "tokens_per_s": round(new_tokens / max(elapsed, 1e-9), 1),
            "bytes": size, "bytes_per_token": round(size / max(tokens, 1), 1), "hidden": hidden, "dtype": dtype}


def _bytes_per_token(target: Target, hidden: bool, dtype: str) -> int:
    """On-disk bytes per token: id, loss mask, and with hidden states the target's argmax and n+1 hidden rows."""
    if not hidden:
        return 5
    width = (len(target.layer_ids) + 1) * target.hidden_size
    return 9 + (2 * width if dtype == "bfloat16" else width + 4 * (len(target.layer_ids) + 1))


def _check_space(out: Path, needed: int) -> None:
    """Before extracting: the bytes the remaining shards need must be free (a full disk mid-way costs a shard)."""
    import shutil

    free = shutil.disk_usage(out).free
    if free < needed:
        raise DraftheadsError(f"feature directory '{out}' needs {needed / 2**20:,.1f} MiB for the remaining features "
                              f"but its disk has {free / 2**20:,.1f} MiB free; free space or point output_dir / "
                              "data.cache_dir elsewhere, then rerun the same command")


def merge_parts(out_dir: str | Path, world: int) -> dict:
    """The main process, after every rank finished its part: manifest.json lists the parts' shards in order."""
    out = Path(out_dir)
    parts = [_read_manifest(out / f"part_{r}-of-{world}.json") for r in range(world)]
    if not all(p["complete"] for p in parts):
        raise DraftheadsError(f"feature directory '{out}': a rank's part is incomplete; rerun the same command")
    merged = {**parts[0], "shards": [s for p in parts for s in p["shards"]],
              "sequences_done": sum(p["sequences_done"] for p in parts), "complete": True, "parts": world}
    write_atomic(out / MANIFEST, json.dumps(merged, indent=1))
    return merged


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
        manifest["shards"], manifest["fingerprint"]  # noqa: B018 (the keys every reader needs)
        return manifest
    except (OSError, ValueError, KeyError, TypeError):
        raise DraftheadsError(f"feature manifest '{path}' is damaged; delete '{path.parent}' and rerun the same command "
                              "to extract the features again") from None


def _changed(out: Path, done: int, now: int) -> DraftheadsError:
    return DraftheadsError(f"feature directory '{out}' holds features of {done} sequences that are not the first {done} "
                           f"of the {now} the data stage gives now (data.* settings, the regenerated text or the chat "
                           "template changed); "
                           "delete it or use a new output_dir")


def _check_merged(out: Path, manifest: dict, sequences) -> dict:
    """A manifest merged from W parts, met by a single process: complete and made of these sequences, or an error."""
    world, n = manifest["parts"], manifest["sequences_done"]
    if len(sequences) != n:
        raise DraftheadsError(f"feature directory '{out}' was extracted by {world} processes from {n} sequences; the "
                              f"data stage now gives {len(sequences)}. Rerun with accelerate.num_processes={world}, or "
                              "delete it")
    for r in range(world):
        lo, hi = part_block(n, r, world)
        mine = [sh for sh in manifest["shards"] if sh["file"].startswith(f"shard_r{r}-of-{world}_")]
        if mine and mine[-1].get("sha256") not in (None, _sequences_digest(sequences[lo:hi]).hexdigest()):
            raise _changed(out, n, len(sequences))
    tokens = sum(s["tokens"] for s in manifest["shards"])
    return {"sequences": n, "tokens": tokens, "new_tokens": 0, "parts": world}


def _kind(manifest: dict) -> str:
    return f"{manifest.get('dtype', 'bfloat16')} hidden states" if manifest.get("hidden", True) else "tokens only"


def _sequences_digest(sequences) -> "hashlib._Hash":
    """SHA-256 over token ids and loss masks, in order: what the manifest's features were extracted from."""
    digest = hashlib.sha256()
    for ids, mask in sequences:
        _digest_update(digest, ids, mask)
    return digest


def _digest_update(digest, ids: Tensor, mask: Tensor) -> None:
    digest.update(ids.to(torch.int64).numpy().tobytes() + mask.to(torch.uint8).numpy().tobytes())


def _feature_forward(target: Target):
    """ids [B, T] right-padded -> TargetOutput without logits. On CPU, for Llama-style targets, the runtime's compact
    forward (float32 weights packed for oneDNN: HF's forward takes MKL's AVX2 path on this AMD CPU); right padding then
    needs no mask, since under causal attention no real token sees a pad. Otherwise (GPU, a sharded target) HF's."""
    from inference.llama import compact_forward

    if target.device.type == "cpu" and not target.sharded:
        try:
            fwd = compact_forward(target)
        except DraftheadsError:
            pass
        else:
            return lambda ids, attn: fwd(ids, fwd.new_cache(ids.shape[0], ids.shape[1]), compute_logits=False)
    return lambda ids, attn: target(ids.to(target.device), attention_mask=attn.to(target.device), compute_logits=False)


def _length_sorted_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices into `lengths` in batches of similar lengths (rows x longest <= batch_tokens, at least one row): sorted
    by length, so right padding costs ~10% instead of ~60% on chat data; the caller writes rows back in order."""
    order = sorted(range(len(lengths)), key=lambda j: lengths[j])
    batches, batch = [], []
    for j in order:  # ascending: a row is the longest of its batch so far
        if batch and (len(batch) + 1) * lengths[j] > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(j)
    return batches + [batch] if batch else batches


def _run_batch(forward, target: Target, seqs: list[Tensor]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(aux [T, nH], final [T, H] float32, target_argmax [T] int32) per sequence, on the target's device. The argmax
    runs the LM head in row chunks (a [T, V] block at a time, not [B, T, V])."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, : len(s)], attn[r, : len(s)] = s, 1
    out = forward(ids, attn)
    result = []
    for r, s in enumerate(seqs):
        final = out.final_hidden[r, : len(s)]
        argmax = torch.cat([greedy_tokens(target.lm_head(final[i: i + 512].to(target.dtype)))
                            for i in range(0, len(s), 512)]).to(torch.int32)
        result.append((out.aux_hidden[r, : len(s)].float(), final.float(), argmax))
    return result


def encode(aux: Tensor, final: Tensor, dtype: str) -> dict:
    """Storage form of one sequence's hidden states: bfloat16, or int8 with a float32 absmax scale per token and layer."""
    if dtype == "bfloat16":
        return {"aux_hidden": aux.to(torch.bfloat16), "final_hidden": final.to(torch.bfloat16)}
    H = final.shape[-1]
    out = {}
    for key, x in (("aux", aux), ("final", final)):
        blocks = x.float().view(*x.shape[:-1], -1, H)  # [..., n, H]
        scale = blocks.abs().amax(-1).clamp(min=1e-12) / 127.0  # [..., n]
        out[f"{key}_hidden"] = (blocks / scale[..., None]).round().clamp(-127, 127).to(torch.int8).view(x.shape)
        out[f"{key}_scale"] = scale
    return out


def decode(stored: dict, H: int) -> tuple[Tensor, Tensor]:
    """(aux, final) float32 from encode's storage form."""
    if "aux_scale" not in stored:
        return stored["aux_hidden"].float(), stored["final_hidden"].float()
    out = []
    for key in ("aux", "final"):
        x = stored[f"{key}_hidden"]
        out.append((x.float().view(*x.shape[:-1], -1, H) * stored[f"{key}_scale"][..., None]).view(x.shape))
    return out[0], out[1]


def round_like_storage(aux: Tensor, final: Tensor, dtype: str) -> tuple[Tensor, Tensor]:
    """Online hidden states with exactly the rounding offline storage applies (so both modes train on equal inputs)."""
    return decode(encode(aux, final, dtype), final.shape[-1])


def _write_shard(out: Path, manifest: dict, buffer: list[dict], sha256: str, prefix: str) -> None:
    """sha256: digest of every sequence of this part up to this shard's last (resume checks the data is the same)."""
    if not buffer:
        return
    lengths = torch.tensor([len(b["input_ids"]) for b in buffer])
    tensors = {"input_ids": torch.cat([b["input_ids"] for b in buffer]).to(torch.int32),
               "loss_mask": torch.cat([b["loss_mask"] for b in buffer]).to(torch.uint8),
               "seq_offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])}
    for key in buffer[0]:
        if key not in ("input_ids", "loss_mask"):
            tensors[key] = torch.cat([b[key] for b in buffer])
    name = f"{prefix}_{len(manifest['shards']):05d}.safetensors"
    save_tensors(out / name, tensors)
    manifest["shards"].append({"file": name, "sequences": len(buffer), "tokens": int(lengths.sum()), "sha256": sha256})
    manifest["sequences_done"] += len(buffer)


class OnlineFeatures:
    """items -> the same items with aux_hidden / final_hidden from one batched target forward, rounded as storage
    would round them: the online counterpart of reading a feature directory (everything after it is shared)."""

    def __init__(self, target: Target, dtype: str = "bfloat16"):
        self.target, self.forward, self.dtype = target, _feature_forward(target), dtype

    @torch.no_grad()
    def __call__(self, items: list[dict]) -> list[dict]:
        states = _run_batch(self.forward, self.target, [it["input_ids"] for it in items])
        return [{**it, **dict(zip(("aux_hidden", "final_hidden"), round_like_storage(aux, final, self.dtype))),
                 "target_argmax": argmax.long()} for it, (aux, final, argmax) in zip(items, states)]


def require_hidden(features, directory, tool: str) -> None:
    """Tools that read stored hidden states refuse a tokens-only directory (data.features=online) by name."""
    if not getattr(features, "hidden", True):
        raise DraftheadsError(f"'{directory}' holds tokens only (a data.features=online run); {tool} reads stored "
                              "hidden states: extract them with data.features=offline (another output_dir), same data")


class FeatureDataset:
    """Sequences of a feature directory: ds[i] -> dict(input_ids [T] long, loss_mask [T] bool and, with hidden states,
    aux_hidden [T, nH] float32, final_hidden [T, H] float32). Rows are read through memory maps (only sequence i's
    bytes); `shard_of` groups sequences by shard for windowed shuffling."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        mpath = self.dir / MANIFEST
        if not mpath.exists():
            raise DraftheadsError(f"'{self.dir}' is not a feature directory (no {MANIFEST}); run the data stage first")
        self.manifest = _read_manifest(mpath)
        if not self.manifest.get("complete"):
            raise DraftheadsError(f"feature directory '{self.dir}' is incomplete (a killed run?); rerun the same "
                                  "command to resume it")
        self.hidden = self.manifest.get("hidden", True)
        self.hidden_size = self.manifest["fingerprint"]["hidden_size"]
        self.index = [(s, j) for s, shard in enumerate(self.manifest["shards"]) for j in range(shard["sequences"])]
        self.shard_of = [s for s, _ in self.index]
        self._open: dict[int, tuple] = {}

    def __len__(self) -> int:
        return len(self.index)

    def _shard(self, s: int):
        if s not in self._open:
            path = self.dir / self.manifest["shards"][s]["file"]
            try:
                handle = safe_open(str(path), framework="pt")
                offsets = handle.get_tensor("seq_offsets")
            except Exception as e:
                raise DraftheadsError(f"feature shard '{path}' cannot be read ({type(e).__name__}: {e}); delete "
                                      f"'{self.dir}' and extract features again") from None
            if len(self._open) >= 64:  # bounded number of open memory maps
                self._open.pop(next(iter(self._open)))
            self._open[s] = (handle, offsets)
        return self._open[s]

    def __getitem__(self, i: int) -> dict:
        return self._read(i, None)

    def lengths(self) -> list[int]:
        """Tokens of every sequence (from the shards' offsets alone)."""
        out = []
        for s in range(len(self.manifest["shards"])):
            offsets = self._shard(s)[1]
            out += (offsets[1:] - offsets[:-1]).tolist()
        return out

    def tokens(self, i: int) -> dict:
        """input_ids and loss_mask of sequence i only (counting tokens reads no hidden states)."""
        return self._read(i, ("input_ids", "loss_mask"))

    def _read(self, i: int, keys) -> dict:
        s, j = self.index[i]
        handle, offsets = self._shard(s)
        a, b = int(offsets[j]), int(offsets[j + 1])
        rows = {key: handle.get_slice(key)[a:b] for key in keys or handle.keys() if key != "seq_offsets"}
        item = {"input_ids": rows["input_ids"].long(), "loss_mask": rows["loss_mask"].bool()}
        if self.hidden and keys is None:
            item["aux_hidden"], item["final_hidden"] = decode(rows, self.hidden_size)
        if "target_argmax" in rows:  # absent from directories written before it was stored
            item["target_argmax"] = rows["target_argmax"].long()
        return item
