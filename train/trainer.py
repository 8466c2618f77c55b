"""The two training stages of a draft head, and what they share: features, batches, the soft-label objective.

`train_draft(cfg, target, features, out_dir)` runs cfg.train.stages in order:
  soft_label  the head matches the frozen target's distribution (train/losses.py) over COD-sampled depths;
  rl          acceptance-rate RL (train/rl.py) from the stage-1 head.
Each stage is a `train.loop.Stage` run by `train.loop.run_stage` (optimizer, accumulation, ranks, logging,
checkpoints); a stage supplies `step_fn(model, micro, temperature) -> (loss, stats)` and, with held-out sequences,
`validate(model, shard)`. The batch of micro-batch `micro` is a pure function of it (batch_indices), so a resumed or
multi-process run reads exactly the batches of an uninterrupted single-process one.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from inference.host_memory import keep_freed_memory
from inference.sampling import greedy_tokens
from models.checkpoint import build_draft, head_from_state, load_draft, read_metrics, save_draft
from models.draft_vocab import build_draft_vocab, extend_draft_vocab, to_draft_ids, token_counts
from models.errors import DraftheadsError
from models.families import family
from models.files import write_atomic
from train.cod import anchor_plan, cod_plan, plan_to
from train.distributed import as_main_sees_it, calls_everywhere
from train.loop import (RunLog, Shard, Stage, Tally, check_settings, check_steps, newest_checkpoint,
                        run_stage)
from train.losses import (KEEP_LOGITS_BYTES, LOSS_CHUNK_ROWS, Softmax, distill_loss, position_weights, token_ce,
                          total_variation)

STAGES = ("soft_label", "rl")


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def open_features(features, target):
    """A feature directory (data.features.FeatureDataset) or any sequence of feature dicts (tests)."""
    if isinstance(features, (str, Path)):
        from data.features import FeatureDataset

        features = FeatureDataset(features)
    manifest = getattr(features, "manifest", None)
    if manifest is not None:
        target.check_fingerprint(manifest["fingerprint"], f"features '{getattr(features, 'dir', '?')}'",
                                 keys=("vocab_size", "hidden_size", "tokenizer_hash", "layer_ids"))
    if len(features) == 0:
        raise DraftheadsError("the feature set is empty; extract features from at least one sequence first")
    return features


class Subset:
    """Sequences `indices` of a feature set (the train / held-out split)."""

    def __init__(self, dataset, indices: list[int]):
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        return self.dataset[self.indices[i]]

    def lengths(self) -> list[int]:
        every = sequence_lengths(self.dataset)
        return [every[i] for i in self.indices]


def token_fields(dataset, i: int) -> dict:
    """input_ids and loss_mask of sequence i: read without its hidden states where the set can (a feature
    directory, or a Subset of one); an in-memory item as it is."""
    if isinstance(dataset, Subset):
        return token_fields(dataset.dataset, dataset.indices[i])
    return dataset.tokens(i) if hasattr(dataset, "tokens") else dataset[i]


class Concat:
    """Two feature sets as one (the domain's training split, then the replayed general sequences)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __len__(self) -> int:
        return len(self.first) + len(self.second)

    def __getitem__(self, i: int) -> dict:
        return self.first[i] if i < len(self.first) else self.second[i - len(self.first)]

    def lengths(self) -> list[int]:
        return [*sequence_lengths(self.first), *sequence_lengths(self.second)]


def with_replay(dataset, path: str | None, fraction: float, target, weights: dict | None = None):
    """`dataset` plus enough sequences of the general feature set at `path` (spread over it) that they make up
    `fraction` of the mixture: fine-tuning on a domain keeps seeing general data, so it forgets less. The general
    set must come from this target: its name, and its weights (`data.prepare.weights_identity`, as the data report
    beside it records them) where `weights` is given."""
    from data.prepare import recorded_weights

    if fraction <= 0:
        return dataset
    if not path:
        raise DraftheadsError(f"train.replay_fraction={fraction} needs train.replay_features=DIR (a feature directory "
                              "of the general data, e.g. the first run's data/features)")
    general = open_features(path, target)
    made_by = getattr(general, "manifest", {}).get("fingerprint", {}).get("name", target.name)
    try:
        made_with = json.loads((Path(path) / ".." / "data_report.json").read_text())["settings"]["target"]
    except (OSError, ValueError, KeyError):
        made_with = None  # features made elsewhere: the manifest's fingerprint is what there is to check
    other_weights = weights is not None and made_with is not None and \
        recorded_weights(made_with.get("weights", {})) != weights
    if made_by != target.name or other_weights:
        raise DraftheadsError(f"train.replay_features '{path}' holds hidden states of target '{made_by}' "
                              f"({made_with.get('weights', {}) if made_with else 'weights unrecorded'}), not of this "
                              f"run's '{target.name}' ({weights or {}}); extract the general data with this target")
    n = min(len(general), round(fraction / (1 - fraction) * len(dataset)))
    if getattr(general, "hidden", True) != getattr(dataset, "hidden", "aux_hidden" in dataset[0]):
        raise DraftheadsError(f"train.replay_features '{path}' and the run's data differ in kind (offline hidden "
                              "states vs online tokens); use the same data.features for both")
    print(f"[draftheads] replay: {n} of {len(general)} general sequences mixed into {len(dataset)} domain ones")
    return Concat(dataset, Subset(general, [i * len(general) // n for i in range(n)]))


def split_holdout(dataset, holdout: int, fraction: float = 1.0):
    """(train, held-out): the last `holdout` sequences are held out, never trained on; training reads the first
    `fraction` of the others (a data curve keeps the held-out set and grows the training set)."""
    n = len(dataset)
    if holdout >= n:
        raise DraftheadsError(f"train.holdout_sequences={holdout} leaves nothing to train on ({n} sequences); "
                              "lower it or add data (data.max_records)")
    held = Subset(dataset, list(range(n - holdout, n))) if holdout > 0 else None
    kept = max(1, round((n - max(holdout, 0)) * fraction))
    return (dataset if kept == n else Subset(dataset, list(range(kept)))), held


LENGTH_GROUP = 64  # train.length_grouped: micro-batches per length-sorted group


def batch_indices(micro: int, batch_size: int, n: int, seed: int, lengths: tuple[int, ...] | None = None) -> list[int]:
    """Sequence ids of micro-batch `micro`: an endless stream of seeded per-epoch permutations. With `lengths`
    (train.length_grouped) each epoch's permutation is cut into groups of LENGTH_GROUP micro-batches, each sorted by
    length and its micro-batches shuffled: every epoch still reads every sequence once, and a micro-batch holds
    sequences of similar lengths (on chat data, right padding falls from ~45% of the real tokens to a few %)."""
    out = []
    for pos in range(micro * batch_size, (micro + 1) * batch_size):
        epoch, i = divmod(pos, n)
        out.append(_epoch_order(n, seed, epoch, batch_size, lengths)[i])
    return out


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int, batch_size: int, lengths: tuple[int, ...] | None) -> list[int]:
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    order = torch.randperm(n, generator=g)
    if lengths is None:
        return order.tolist()
    # groups start where micro-batches do in the endless stream, so a micro-batch never spans two groups
    first = -epoch * n % batch_size
    cuts = [0, first, *range(first + LENGTH_GROUP * batch_size, n, LENGTH_GROUP * batch_size), n]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        group = order[a:b]
        group = group[torch.tensor([lengths[i] for i in group.tolist()]).argsort(descending=True, stable=True)]
        batches = list(group.split(batch_size))
        out += [int(i) for j in torch.randperm(len(batches), generator=g).tolist() for i in batches[j]]
    return out


def sequence_lengths(dataset) -> tuple[int, ...]:
    """Tokens of every sequence, without reading hidden states."""
    if hasattr(dataset, "lengths"):
        return tuple(dataset.lengths())
    return tuple(len(dataset[i]["input_ids"]) for i in range(len(dataset)))


def collate(items: list[dict], device) -> dict:
    """Right-padded batch: input_ids [B, T], loss_mask [B, T], aux_hidden [B, T, nH], final_hidden [B, T, H],
    target_argmax [B, T] (when every item has it), lengths [B]."""
    lengths = torch.tensor([len(x["input_ids"]) for x in items])
    T = int(lengths.max())
    out = {"lengths": lengths.to(device)}
    optional = [k for k in ("target_argmax",) if all(k in x for x in items)]
    for key in ("input_ids", "loss_mask", "aux_hidden", "final_hidden", *optional):
        first = items[0][key]
        buf = first.new_zeros((len(items), T, *first.shape[1:]))
        for r, x in enumerate(items):
            buf[r, : len(x[key])] = x[key]
        out[key] = buf.to(device)
    return out


# ---------------------------------------------------------------------------------------------
# stage 1: soft labels
# ---------------------------------------------------------------------------------------------
def draft_labels(target, head, batch: dict, out, chunk: slice | Tensor):
    """For the rows `chunk` (a slice or indices): the target's logits once per distinct label position [u, V_draft]
    (no grad) with `where` [n] (row i's logits are row where[i]), token labels [n] and the target's greedy token [n]
    (draft-vocab ids, -1 outside the draft vocabulary). COD and block plans label ~3 rows at each position (depths of
    neighbouring anchors), so the target's LM head and log-softmax run on a third of the rows. The greedy token is the
    whole-vocabulary argmax the features carry (target_argmax): a head with a reduced vocabulary cannot agree where
    the target's choice lies outside it. Features without it fall back to the argmax over the draft vocabulary (an
    overestimate for such heads)."""
    b, rows = out.batch_index[chunk], (out.anchor + out.depth)[chunk]  # target row t+d predicts token t+d+1
    positions, where = torch.unique(label_position(batch, b, rows), return_inverse=True)
    width = batch["input_ids"].shape[1]
    tgt = _target_logits(target, head, batch, positions // width, positions % width)
    labels = _to_draft(head, batch["input_ids"][b, rows + 1])
    return tgt, where, labels, target_greedy(target, head, batch, out, chunk, (tgt, where))


def label_position(batch: dict, b: Tensor, rows: Tensor) -> Tensor:
    """One integer per (sequence b, target row): rows that share it share the target's distribution."""
    return b * batch["input_ids"].shape[1] + rows


def target_greedy(target, head, batch: dict, out, chunk: slice | Tensor, logits: tuple | None = None) -> Tensor:
    """draft_labels' greedy token alone: the features' target_argmax when they carry it (no LM-head matmul), else
    the argmax of the target's draft-vocabulary logits (`logits`: draft_labels' (tgt, where), when given)."""
    b, rows = out.batch_index[chunk], (out.anchor + out.depth)[chunk]
    if "target_argmax" in batch:
        return _to_draft(head, batch["target_argmax"][b, rows])
    if logits is None:
        return greedy_tokens(_target_logits(target, head, batch, b, rows))
    tgt, where = logits
    return greedy_tokens(tgt)[where]


def _target_logits(target, head, batch: dict, b: Tensor, rows: Tensor) -> Tensor:
    final = batch["final_hidden"][b, rows].to(target.dtype)
    with torch.no_grad():  # the target restricted to the draft vocabulary: only those rows of its LM head (N/V the cost)
        weight, bias = lm_head_rows(target.model.get_output_embeddings(), head.draft_ids, final.device.type)
        return F.linear(final, weight, bias)


def _to_draft(head, tokens: Tensor) -> Tensor:
    """Target-vocabulary ids as the head's draft-vocabulary ids (-1 outside it); unchanged for a full-vocabulary head."""
    if head.draft_ids is None:
        return tokens
    return to_draft_ids(head.t2d, tokens, outside=-1)


def lm_head_rows(lm, ids: Tensor | None, device_type: str) -> tuple[Tensor, Tensor | None]:
    """(weight, bias) of the target's LM head restricted to rows `ids` (None: all), in the dtype the matmul runs in
    (autocast's, when it is on). Made once per weight, ids and dtype: the loss reads them for every chunk of rows, and
    gathering and casting 8192 x 576 rows each time took ~10% of a CPU training step. Kept on the module."""
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else lm.weight.dtype
    key = (lm.weight.data_ptr(), lm.weight._version, dtype)
    hit = getattr(lm, "_draftheads_rows", None)
    if hit is not None and hit[0] == key and (hit[1] is None) == (ids is None) and \
            (ids is None or torch.equal(hit[1], ids)):
        return hit[2]
    rows = (lm.weight, lm.bias) if ids is None else (lm.weight[ids], None if lm.bias is None else lm.bias[ids])
    value = tuple(None if t is None else t.detach().to(dtype) for t in rows)
    lm._draftheads_rows = (key, None if ids is None else ids.clone(), value)
    return value


def online_features(dataset, target, dtype: str):
    """None when the dataset's items carry hidden states (offline); else the target computes them in the step."""
    from data.features import OnlineFeatures

    has_hidden = getattr(dataset, "hidden", None)
    if has_hidden is None:
        has_hidden = "aux_hidden" in dataset[0]
    return None if has_hidden else OnlineFeatures(target, dtype)


def prepare_batch(items: list[dict], device, fill=None) -> dict:
    """Feature items -> one padded batch on `device`; `fill` (online runs) adds the target's hidden states first."""
    return collate(fill(items) if fill is not None else items, device)


def soft_label_loss(target, tc, k: int, family_name: str, device, fill=None, anchor_weights=None):
    """(model, items, micro, temperature) -> (loss, stats): the soft-label objective on a batch of feature items (or
    on their prepare_batch). Plans (COD depths, or block anchors) are seeded by `micro`; everything that reads the
    head's parameters runs inside its forward (models.layers.TrainableHead), so a sharded wrapper has them gathered.
    anchor_weights(model, batch) -> [B, T] (train.chain.round_start_weights) weights each row by its anchor."""
    gamma = tc.position_gamma or k

    def loss_on(model, items: list[dict] | dict, micro: int, temperature: float):
        batch = items if isinstance(items, dict) else prepare_batch(items, device, fill)
        g = torch.Generator().manual_seed(tc.seed * 1_000_003 + micro)
        blocks = family(family_name).blocks  # whole blocks at random anchors, or COD-sampled depths
        make_plan = anchor_plan if blocks else cod_plan
        knob = tc.anchors_per_sequence if blocks else tc.cod_decay
        plan = plan_to(make_plan(batch["loss_mask"].cpu(), batch["lengths"].cpu(), k, knob, g), device)
        weights = None if anchor_weights is None else anchor_weights(model, batch)
        return model(batch, plan,
                     lambda core, out: _objective(core, target, batch, out, tc, temperature, gamma, k, weights))

    return loss_on


def soft_label_step_fn(target, dataset, tc, k: int, family_name: str, device, fill=None):
    """The loop's step function: micro-batch `micro` of the training split (batch_indices); with
    train.round_start_weight the rows drafted from the head's greedy round starts weigh 1 + that (validation does not
    weight)."""
    from train.chain import round_start_weights  # imports this module

    weights = round_start_weights(target, k, tc.round_start_weight) if tc.round_start_weight > 0 else None
    loss_on = soft_label_loss(target, tc, k, family_name, device, fill, weights)
    lengths = sequence_lengths(dataset) if tc.length_grouped else None

    def step_fn(model, micro: int, temperature: float):
        t0 = time.perf_counter()
        items = [dataset[i] for i in batch_indices(micro, tc.batch_size, len(dataset), tc.seed, lengths)]
        data_s = time.perf_counter() - t0
        loss, stats = loss_on(model, items, micro, temperature)
        return loss, {**stats, "data_s": data_s}

    return step_fn


def _objective(core, target, batch: dict, out, tc, temperature: float, gamma: float, k: int,
               anchor_weights: Tensor | None = None):
    """Weighted loss over the head's rows, in chunks of LOSS_CHUNK_ROWS, and per-depth agreement (hits, rows)."""
    n = out.hidden.shape[0]
    w = position_weights(out.depth, tc.position_weighting, gamma)
    if anchor_weights is not None:
        w = w * anchor_weights[out.batch_index, out.anchor]
    total = out.hidden.sum() * 0.0  # keeps the graph when a micro-batch has no labelled rows
    agree = torch.zeros(n, device=out.hidden.device)
    # rows in order of their label position: the rows that share one fall in the same chunk (see draft_labels)
    order = torch.argsort(label_position(batch, out.batch_index, out.anchor + out.depth), stable=True)
    for c in range(calls_everywhere(-(-n // LOSS_CHUNK_ROWS), core, out.hidden.device)):  # ZeRO-3: alike on all ranks
        chunk = order[c * LOSS_CHUNK_ROWS: (c + 1) * LOSS_CHUNK_ROWS]
        tgt, where, labels, best = draft_labels(target, core, batch, out, chunk)
        ref = _regression_target(core, batch, out, chunk, tc)
        part, hit = _chunk_loss(core, out.hidden[chunk], out.depth[chunk], Softmax(tgt, temperature).take(where),
                                labels, best, w[chunk], tc, temperature, ref)
        total = total + part
        agree[chunk] = hit
    stats = {"tokens": int(batch["lengths"].sum())}
    for d in range(1, k + 1):
        sel = out.depth == d
        stats[f"acc_{d}"] = (float(agree[sel].sum()), int(sel.sum()))
    return total / w.sum().clamp(min=1e-6), stats


def tau_estimate(acc: list[float], first: float | None = None) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the greedy chain's τ if acceptance at depth k, given every earlier depth right, were
    acc_k (val_tau_est); `first` replaces acc_1 (eval.depth_ceiling)."""
    tau, run = 1.0, 1.0
    for d, a in enumerate(acc):
        run *= first if (d == 0 and first is not None) else a
        tau += run
    return tau


def validation_fn(loss_on, holdout, batch_size: int, k: int, chain=None, prepare=None):
    """validate(model, shard) -> {"val_loss", "val_acc_1".., "val_tau_est"[, "val_tau_chain"]}: the stage's own
    objective on every held-out sequence once (consecutive batches at fixed seeds, so numbers compare across steps),
    batches split over ranks. val_tau_est = 1 + sum_k prod_{j<=k} acc_j, the τ greedy decoding would get if every
    position were as easy as the average one; val_tau_chain (chain = train.chain.chain_fn) walks the greedy chain over
    the held-out answers, rounds starting where the last one was rejected: what serving measures (regenerated data).
    prepare (prepare_batch, needed with chain): items -> batch, made once for the loss and the chain."""
    n_batches = math.ceil(len(holdout) / batch_size)

    def validate(model, shard: Shard = Shard()) -> dict:
        tally = Tally()
        for b, real in shard.calls(n_batches):
            items = [holdout[i] for i in range(b * batch_size, min((b + 1) * batch_size, len(holdout)))]
            if prepare is not None:
                items = prepare(items)  # online runs: one target forward for both
            loss, stats = loss_on(model, items, b, 1.0)
            walked = chain(model, items) if chain is not None else None
            if real:
                tally.add("val_loss", float(loss.detach()))
                for d in range(1, k + 1):
                    tally.add(f"val_acc_{d}", stats[f"acc_{d}"])
                if walked is not None:
                    tally.add("val_tau_chain", walked)  # tokens emitted / rounds
        means = shard.reduce(tally)
        out = {"val_loss": round(means["val_loss"], 6)}
        acc = []
        for d in range(1, k + 1):
            if f"val_acc_{d}" not in means:
                break
            acc.append(round(means[f"val_acc_{d}"], 4))
            out[f"val_acc_{d}"] = acc[-1]
        out["val_tau_est"] = round(tau_estimate(acc), 4)
        if "val_tau_chain" in means:
            out["val_tau_chain"] = round(means["val_tau_chain"], 4)
        return out

    return validate


def soft_label_validation(target, tc, k: int, family_name: str, holdout, fill=None):
    """validation_fn of the soft-label objective on `holdout`, with the greedy chain's walk (val_tau_chain) where
    train.val_tau_chain: stage 1's validation, and the τ half of RL's."""
    from train.chain import chain_fn  # imports this module

    return validation_fn(soft_label_loss(target, tc, k, family_name, target.device, fill), holdout, tc.batch_size, k,
                         chain_fn(target, k) if tc.val_tau_chain else None,
                         functools.partial(prepare_batch, device=target.device, fill=fill))


def _regression_target(core, batch: dict, out, chunk: slice | Tensor, tc) -> Tensor | None:
    """The target's LM-head input at each row's label position (train.hidden_weight > 0), for heads whose output
    rows are their own LM-head input (P-EAGLE, EAGLE-3); None when the term is off."""
    if tc.hidden_weight <= 0:
        return None
    final = batch["final_hidden"][out.batch_index[chunk], (out.anchor + out.depth)[chunk]]
    if final.shape[-1] != out.hidden.shape[-1] or not family(core.family_name).hidden_state:
        raise DraftheadsError(f"train.hidden_weight={tc.hidden_weight} regresses the head's LM-head input onto the "
                              f"target's; a {core.family_name} head has no such state. Set train.hidden_weight=0")
    return final


def _chunk_loss(core, hidden, depth, p: Softmax, labels, best, w, tc, temperature, ref=None):
    """Weighted loss sum of one chunk; p: the target's softmax per row, at `temperature`, computed outside the
    checkpointed part. The draft's logits are kept for backward when a full chunk's are at most KEEP_LOGITS_BYTES (a
    draft vocabulary), else recomputed in backward (checkpoint) so only one chunk is alive: decided by the vocabulary,
    not the chunk's rows, so every chunk (and every rank, under ZeRO-3) calls the head's modules alike.
    ref: the target's LM-head input per row for hidden-state regression (EAGLE's SmoothL1 feature loss), or None."""

    def f(h):
        logits = core.logits_for(h, depth)
        q = Softmax(logits, temperature)
        per = tc.distill_weight * distill_loss(tc.loss, p, q, tv_weight=tc.lk_tv_weight)
        if tc.temperature.scale_loss:  # soft targets at T: gradients shrink ~1/T^2 beside the CE at T = 1
            per = per * temperature ** 2
        if ref is not None:
            per = per + tc.hidden_weight * F.smooth_l1_loss(h.float(), ref.float(), reduction="none").mean(-1)
        if tc.ce_weight > 0:
            per = per + tc.ce_weight * token_ce(q, labels)
        if tc.confidence_weight > 0 and hasattr(core, "confidence_logit"):  # DSpark: c_k learns 1 - TV_k at T = 1
            survive = 1.0 - total_variation(p, q, temperature=1.0).detach()  # not the annealed distillation T
            c_logit = core.confidence_logit(h, depth).float()
            per = per + tc.confidence_weight * F.binary_cross_entropy_with_logits(c_logit, survive, reduction="none")
        return (per * w).sum(), (greedy_tokens(logits.detach()) == best).float()

    if hidden.requires_grad and LOSS_CHUNK_ROWS * p.log_p.shape[-1] * 4 > KEEP_LOGITS_BYTES:
        part, hit = torch.utils.checkpoint.checkpoint(f, hidden, use_reentrant=False)
    else:
        part, hit = f(hidden)
    return part, hit.detach()


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def train_draft(cfg, target, features, out_dir, stop_at_step: int | None = None, accelerator=None,
                wandb_run=None) -> Path:
    """Run cfg.train.stages; the final head is written (main process) with models/checkpoint.py to out_dir/head.
    Every stage starts from a head on disk (draft.init_from, or the previous stage's) and ends by writing one, so a
    rerun resumes where the last one stopped and a stage is the same code for 1 or N processes."""
    from omegaconf import OmegaConf

    from train.distributed import make_accelerator

    out = Path(out_dir)
    dc, tc = cfg.draft, cfg.train
    bad = [s for s in tc.stages if s not in STAGES]
    if bad or not tc.stages:
        raise DraftheadsError(f"train.stages {list(tc.stages)} must be a non-empty list of {list(STAGES)}")
    if "rl" in tc.stages:  # before stage 1's hours, not after them
        from train.rl import check_rl_target

        check_rl_target(target)
    accelerator = accelerator or make_accelerator(cfg.accelerate, tc, target.device.type)
    keep_freed_memory()  # the loss's large temporaries reuse heap memory (inference/host_memory.py)
    main = accelerator.is_main_process
    if main:
        out.mkdir(parents=True, exist_ok=True)
    everything = open_features(features, target)
    fill = online_features(everything, target, cfg.data.feature_dtype)
    dataset, holdout = split_holdout(everything, tc.holdout_sequences, tc.data_fraction)
    dataset = with_replay(dataset, tc.replay_features, tc.replay_fraction, target, _weights_of(cfg))
    resolved = OmegaConf.to_yaml(cfg, resolve=True) if OmegaConf.is_config(cfg) else None
    torch.manual_seed(tc.seed)  # every rank builds the same fresh head
    own_wandb = wandb_run is None and tc.wandb and main  # train.distill passes its run (it logs τ after training)
    log = RunLog(out / "metrics.jsonl", main, open_wandb(cfg, out) if own_wandb else wandb_run)
    start, metrics = dc.init_from, {}

    data_id = data_identity(everything)
    domain = dataset.first if isinstance(dataset, Concat) else dataset  # without the replayed general sequences
    # keys newer than a run's recorded settings count as equal there (check_settings): older runs still resume
    replay = {"replay_data": data_identity(dataset.second.dataset)} if domain is not dataset else {}
    if "soft_label" in tc.stages:
        stage_dir = out / "head_soft_label"
        settings = stage_settings(cfg, "soft_label", data_id, dc.init_from, accelerator.num_processes) | replay | \
            ({"start_weights": _head_identity(dc.init_from)} if dc.init_from else {})
        finished, longer = as_main_sees_it(accelerator, lambda: _stage_one_done(stage_dir, out, settings, tc))
        if finished and not longer:
            if main:
                print(f"[draftheads] soft_label: already done ({stage_dir})")
        else:
            if main and stage_dir.exists() and not longer:  # an earlier head (resume=false) or an unfinished save
                shutil.rmtree(stage_dir)  # (one to train on stays until the longer run's head replaces it)
            if main and longer:
                print(f"[draftheads] soft_label: train.steps={tc.steps} is past the head's steps: training on from "
                      "its last checkpoint" + ("; RL's checkpoints, made from the old head, are removed" if
                                               (out / "checkpoints_rl").exists() else ""))
                shutil.rmtree(out / "checkpoints_rl", ignore_errors=True)
            accelerator.wait_for_everyone()
            head = _trainable(_initial_head(dc, target, domain), tc)
            validate = None if holdout is None else soft_label_validation(target, tc, dc.k, head.family_name,
                                                                          holdout, fill)
            stage = Stage("soft_label", tc.steps, tc.lr, tc.warmup_steps,
                          soft_label_step_fn(target, dataset, tc, dc.k, head.family_name, target.device, fill),
                          out / "checkpoints", validate, settings=settings, keep_best_by=_keep_best_key(tc))
            finished, state, metrics = run_stage(accelerator, head, stage, tc, log, stop_at_step)
            accelerator.free_memory()
            if not finished:
                return out  # simulated kill: no head
            metrics = {**metrics, "steps": tc.steps}  # recorded with the head: what a rerun with more steps reads
            _save_head(accelerator, head, state, stage_dir, target, resolved, metrics, settings)
        start = stage_dir

    if "rl" in tc.stages:
        from train.rl import train_rl

        if not start:
            raise DraftheadsError("train.stages=[rl] needs draft.init_from=DIR (a stage-1 head) to start from")
        head = _trainable(check_start(load_draft(start, target), dc, start), tc)
        settings = stage_settings(cfg, "rl", data_id, _head_identity(start), accelerator.num_processes) | replay
        finished, state, metrics = train_rl(cfg, head, target, dataset, holdout, out, log, accelerator, stop_at_step,
                                            fill, settings)
        accelerator.free_memory()
        if not finished:
            return out
        _save_head(accelerator, head, state, out / "head", target, resolved, metrics, settings)
    else:
        head = load_draft(start, target)
        if main:
            save_draft(head, out / "head", target, resolved, metrics or read_metrics(start))
        accelerator.wait_for_everyone()
    if own_wandb:
        log.wandb_run.finish()
    return out / "head"


def _weights_of(cfg) -> dict:
    """The run's target weights as the data stage records them."""
    from data.prepare import weights_identity

    return weights_identity(cfg.target.path, cfg.target.dtype)


def _keep_best_key(tc) -> str:
    """What stage 1 keeps its best weights by: train.keep_best_by, val_loss where the chain is not walked."""
    return tc.keep_best_by if tc.val_tau_chain else "val_loss"


NOT_SHAPING = {"steps", "rl_steps", "checkpoint_every", "eval_every", "val_tau_chain", "log_every", "resume", "wandb",
               "wandb_project", "dry_run", "stages"}


def stage_settings(cfg, stage: str, data_id, start, processes: int = 1) -> dict:
    """What shapes a stage's weights, flat: draft.*, train.* (RL's knobs for RL only; steps may be raised to train
    longer), the data it reads, the head it starts from and the process count (each step reads train.grad_accum
    micro-batches per process: resuming with another count would re-read or skip data) and the layout its checkpoints
    are written in (accelerate.strategy: single / ddp, fsdp, zero*). Recorded with its checkpoints and its head."""
    from omegaconf import OmegaConf

    flat = {f"draft.{k}": v for k, v in OmegaConf.to_container(cfg.draft, resolve=True).items()}
    for k, v in OmegaConf.to_container(cfg.train, resolve=True).items():
        if k not in NOT_SHAPING and (stage == "rl" or not k.startswith("rl_")):
            flat[f"train.{k}"] = v
    strategy = cfg.accelerate.strategy
    layout = "deepspeed" if strategy.startswith("zero") else "fsdp" if strategy == "fsdp" else "plain"
    return {"stage": stage, **flat, "data": data_id, "start": None if start is None else str(start),
            "processes": processes, "checkpoint_layout": layout}  # DeepSpeed / FSDP checkpoints read only as written


def data_identity(dataset) -> str | None:
    """A feature directory's identity: its sequence count and the digest of its last shard (in-memory data: none)."""
    manifest = getattr(dataset, "manifest", None)
    if manifest is None:
        return None
    return f"{manifest['sequences_done']} sequences, {manifest['shards'][-1].get('sha256')}"


def _save_head(accelerator, head, state: dict | None, out_dir: Path, target, resolved, metrics, settings) -> None:
    """The main process writes the head with `state` (the full state dict run_stage returned) and the settings that
    made it beside `out_dir`, then puts it in the place of any head there (a kill keeps the old head or leaves none;
    a rerun saves it again from the last checkpoint); the others wait."""
    if accelerator.is_main_process:
        final = head_from_state(head.family_name, head.config, state, target, f"the trained {head.family_name} head")
        tmp = out_dir.with_name(out_dir.name + ".saving")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_atomic(tmp / "settings.json", json.dumps(settings, indent=1, sort_keys=True))
        save_draft(final, tmp, target, resolved, metrics)  # config.json last: the head is complete
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()


def _head_identity(head_dir) -> str:
    """A starting head: its path and the digest of its weight files (a head retrained in place is another start; a
    missing directory is named by the load that follows)."""
    import hashlib

    files = sorted(Path(head_dir).glob("*.safetensors")) + sorted(Path(head_dir).glob("*.bin"))
    digests = []
    for path in files:
        with open(path, "rb") as f:
            digests.append(hashlib.file_digest(f, "sha256").hexdigest())
    if not digests:
        return str(head_dir)
    whole = digests[0] if len(digests) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()
    return f"{head_dir} sha256:{whole[:16]}"


def _stage_one_done(stage_dir: Path, out: Path, settings: dict, tc) -> tuple[bool, bool]:
    """(finished, longer): a stage-1 head in stage_dir, made with these settings, to reuse (resume on), and whether it
    trains on to train.steps (`_trains_on`)."""
    finished = (stage_dir / "config.json").is_file() and tc.resume
    if finished and (stage_dir / "settings.json").is_file():
        check_settings(stage_dir / "settings.json", settings, f"the stage-1 head in '{stage_dir}'",
                       ignore=("processes", "checkpoint_layout"))  # used alike; training on checks checkpoints
    return finished, finished and _trains_on(stage_dir, out / "checkpoints", tc.steps)


def _trains_on(stage_dir: Path, ckpt_root: Path, steps: int) -> bool:
    """Whether a finished stage-1 head trains on to `steps` (train.steps raised) from its last checkpoint: the steps
    it ran are recorded with it (older heads: its newest checkpoint's, else unknown: done). It resumes from its own
    last checkpoint or a later one (an extension killed on the way). Fewer steps than it ran, or no checkpoint from
    its last step on, is an error naming train.steps."""
    newest = newest_checkpoint(ckpt_root)[0]
    trained = read_metrics(stage_dir).get("steps", newest or None)
    if trained is None or trained == steps:
        return False
    check_steps(trained, steps, stage_dir, "train.steps")
    if newest is None or newest < trained:
        raise DraftheadsError(f"train.steps={steps} would train '{stage_dir}' on past its {trained} steps, but "
                              f"its step-{trained} checkpoint is not in '{ckpt_root}'; set train.steps={trained} to "
                              "use the head as it is, or train.resume=false to start over")
    return True


def _initial_head(dc, target, dataset):
    if not dc.share_embedding:
        raise DraftheadsError("draft.share_embedding=false is not supported: heads read the target's frozen token "
                              "embedding (as vLLM's EAGLE-3 loader does when embed_tokens is absent); set it to true")
    if dc.vocab_extend and not dc.init_from:
        raise DraftheadsError(f"draft.vocab_extend={dc.vocab_extend} extends an existing head's draft vocabulary: set "
                              "draft.init_from=DIR, or draft.draft_vocab_size for a new head")
    if dc.init_from:  # domain fine-tuning: continue from an existing head (same family/sizes as recorded there)
        head = check_start(load_draft(dc.init_from, target), dc, dc.init_from)
        if dc.vocab_extend:
            tokens = getattr(dataset, "tokens", dataset.__getitem__)
            counts = token_counts((tokens(i) for i in range(len(dataset))), target.vocab_size)
            added = extend_draft_vocab(head, target, counts, dc.vocab_extend)
            print(f"[draftheads] draft vocabulary: +{added} domain tokens (rows from the target's LM head)")
        return head
    vocab = None
    if dc.draft_vocab_size is not None and dc.draft_vocab_size < target.vocab_size:
        tokens = getattr(dataset, "tokens", dataset.__getitem__)  # ids and masks only, where the dataset can
        vocab = build_draft_vocab((tokens(i) for i in range(len(dataset))), dc.draft_vocab_size, target.vocab_size)
    return build_draft(dc.family, target, dc.k, dc.num_layers, dc.parallel, vocab, dc.share_lm_head, dict(dc.extra))


def check_start(head, dc, where):
    """A head a run starts from (draft.init_from) has the run's family, K and depth: the loss and the τ table follow
    draft.*, so a head of another shape would train depths it lacks or record a K it was not trained at."""
    from models.families import family

    asked = {"draft.family": dc.family, "draft.parallel": dc.parallel, "draft.k": dc.k,
             "draft.num_layers": dc.num_layers}
    has = {"draft.family": dc.family if isinstance(head, family(dc.family).head) else head.family_name,
           "draft.parallel": head.config.get("parallel"),  # P-EAGLE's class: peagle (true) or eagle3 (false)
           "draft.k": head.k, "draft.num_layers": head.config.get("num_layers")}
    diff = [f"{k}={asked[k]} (the head's: {has[k]})" for k in asked if has[k] is not None and has[k] != asked[k]]
    if diff:
        raise DraftheadsError(f"draft.init_from '{where}' is another shape of head than the run asks for: "
                              f"{', '.join(diff)}; set those to the head's (a fine-tune keeps its head's shape), or "
                              "start a new head without draft.init_from")
    return head


def _trainable(head, tc):
    """Train mode, gradients on; float32 master weights under mixed precision (autocast computes in bf16)."""
    if tc.mixed_precision != "no":
        head.float()
    head.train()
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def open_wandb(cfg, out: Path):
    """The run's W&B run (main process only), in WANDB_MODE as the user set it (offline: sync later with `wandb
    sync`); its directory is under the run's output directory."""
    try:
        import wandb
    except ImportError:
        raise DraftheadsError("train.wandb=true needs the wandb package: `pip install wandb` "
                              "(or set train.wandb=false; metrics.jsonl is always written)") from None
    from omegaconf import OmegaConf

    return wandb.init(project=cfg.train.wandb_project, name=str(cfg.get("name", "draft")), dir=str(out),
                      config=OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else None)
