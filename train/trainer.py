"""One training loop for every drafter and both stages, on `accelerate`.

`train_draft(cfg, target, features, out_dir)` runs cfg.train.stages in order:
  soft_label  the head matches the frozen target's distribution (train/losses.py) over COD-sampled depths;
  rl          acceptance-rate RL (train/rl.py) from the stage-1 head.
Both stages go through `run_loop`: a stage only supplies `step_fn(micro_step, temperature) -> (loss, stats)`.
The loop owns AdamW + warmup/cosine, gradient accumulation, mixed precision, metrics (out/metrics.jsonl, W&B
when enabled, tqdm) and checkpoints that resume exactly: model, optimizer, scheduler and RNG states through
accelerate's save_state, and the data position, which is a pure function of the micro-step (batch order and
COD sampling are seeded by it), so nothing else needs saving.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

from models.checkpoint import build_draft, load_draft, save_draft
from models.draft_vocab import build_draft_vocab
from models.errors import DraftheadsError
from train.cod import anchor_plan
from train.cod import cod_plan
from train.losses import distill_loss, position_weights, token_ce, total_variation
from train.temperature import temperature_at

STAGES = ("soft_label", "rl")
BLOCK_FAMILIES = ("dspark", "dflash")  # train on whole blocks at random anchors (train/cod.py anchor_plan)
LOSS_CHUNK_ROWS = 1024  # rows of [N, V] logits alive at once: 1024 x 49152 fp32 = 200 MB


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


def split_holdout(dataset, holdout: int):
    """(train, held-out): the last `holdout` sequences are held out; never trained on."""
    n = len(dataset)
    if holdout <= 0:
        return dataset, None
    if holdout >= n:
        raise DraftheadsError(f"train.holdout_sequences={holdout} leaves nothing to train on ({n} sequences); "
                              "lower it or add data (data.max_records)")
    return Subset(dataset, list(range(n - holdout))), Subset(dataset, list(range(n - holdout, n)))


def batch_indices(micro: int, batch_size: int, n: int, seed: int) -> list[int]:
    """Sequence ids of micro-batch `micro`: an endless stream of seeded per-epoch permutations."""
    out = []
    for pos in range(micro * batch_size, (micro + 1) * batch_size):
        epoch, i = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        out.append(int(perm[i]))
    return out


def collate(items: list[dict], device) -> dict:
    """Right-padded batch: input_ids [B, T], loss_mask [B, T], aux_hidden [B, T, nH], final_hidden [B, T, H], lengths [B]."""
    lengths = torch.tensor([len(x["input_ids"]) for x in items])
    T = int(lengths.max())
    out = {"lengths": lengths.to(device)}
    for key in ("input_ids", "loss_mask", "aux_hidden", "final_hidden"):
        first = items[0][key]
        buf = first.new_zeros((len(items), T, *first.shape[1:]))
        for r, x in enumerate(items):
            buf[r, : len(x[key])] = x[key]
        out[key] = buf.to(device)
    return out


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------
def lr_lambda(warmup: int, steps: int, floor: float = 0.1):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        x = (step - warmup) / max(1, steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(x, 1.0)))

    return f


def newest_checkpoint(ckpt_root: Path) -> Path | None:
    done = [p for p in ckpt_root.glob("step_*") if (p / "trainer_state.json").is_file()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def run_loop(model, step_fn: Callable[[int, float], tuple[Tensor, dict]], *, steps: int, lr: float, warmup: int,
             weight_decay: float, max_grad_norm: float, grad_accum: int, mixed_precision: str, ckpt_root: Path,
             checkpoint_every: int, log_every: int, metrics_path: Path, stage: str, temperature_cfg, resume: bool,
             cpu: bool, wandb_run=None, stop_at_step: int | None = None, keep_checkpoints: int = 2,
             validate: Callable[[], dict] | None = None, eval_every: int = 0, keep_best: bool = True) -> dict:
    """Optimise `model` for `steps` optimizer steps; returns the last logged metrics.

    With `validate` (() -> {"val_loss": ..., ...}), every `eval_every` steps and at the end the metrics are logged and
    (keep_best) the weights with the lowest val_loss are kept in ckpt_root/best (early stopping) and loaded back at the
    end. keep_best=False (RL, whose objective is not val_loss) only logs, step 0 included, so before/after sit side by side.
    """
    from accelerate import Accelerator
    from tqdm import tqdm

    accelerator = Accelerator(gradient_accumulation_steps=grad_accum, mixed_precision=mixed_precision, cpu=cpu)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup, steps))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    step = 0
    last = newest_checkpoint(ckpt_root) if resume else None
    if last is not None:
        accelerator.load_state(str(last))
        step = json.loads((last / "trainer_state.json").read_text())["step"]
        print(f"[draftheads] {stage}: resumed from {last} (step {step})")
    _truncate_metrics(metrics_path, stage, step)
    if validate is not None and not keep_best and step == 0:
        _validate(accelerator.unwrap_model(model), validate, 0, stage, None, metrics_path, wandb_run)
    t_steps = temperature_cfg.steps or steps
    bar = tqdm(total=steps, initial=step, desc=stage, disable=not accelerator.is_main_process)
    logged: dict = {}
    window = {"loss": 0.0, "tokens": 0, "n": 0, "acc": {}, "t0": time.perf_counter()}
    while step < steps:
        temperature = temperature_at(step, temperature_cfg.start, temperature_cfg.end, temperature_cfg.schedule, t_steps)
        for j in range(grad_accum):
            with accelerator.accumulate(model):
                loss, stats = step_fn(step * grad_accum + j, temperature)
                accelerator.backward(loss)
                if accelerator.sync_gradients and max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window["loss"] += float(loss.detach()) / grad_accum
            window["tokens"] += stats.pop("tokens", 0)
            for key, v in stats.items():
                window["acc"].setdefault(key, []).append(v)
        step += 1
        window["n"] += 1
        bar.update(1)
        if step % log_every == 0 or step == steps:
            elapsed = time.perf_counter() - window["t0"]
            logged = {"stage": stage, "step": step, "loss": round(window["loss"] / window["n"], 6),
                      "lr": scheduler.get_last_lr()[0], "temperature": round(temperature, 4),
                      "tokens_per_s": round(window["tokens"] / max(elapsed, 1e-9), 1)}
            for key, vs in sorted(window["acc"].items()):
                vs = [v for v in vs if v == v]  # NaN = no rows at that depth in a micro-batch
                if vs:
                    logged[key] = round(sum(vs) / len(vs), 4)
            if accelerator.is_main_process:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(logged) + "\n")
                if wandb_run is not None:
                    wandb_run.log(logged, step=step)
            bar.set_postfix(loss=logged["loss"])
            window = {"loss": 0.0, "tokens": 0, "n": 0, "acc": {}, "t0": time.perf_counter()}
        if validate is not None and (step % eval_every == 0 or step == steps):
            _validate(accelerator.unwrap_model(model), validate, step, stage, ckpt_root / "best" if keep_best else None,
                      metrics_path, wandb_run)
        if step % checkpoint_every == 0 or step == steps:
            _save_checkpoint(accelerator, ckpt_root, step, keep_checkpoints)
        if stop_at_step is not None and step >= stop_at_step:  # tests: simulate a kill after this step
            break
    bar.close()
    if validate is not None and keep_best and step >= steps and (ckpt_root / "best" / "best.json").is_file():
        best = json.loads((ckpt_root / "best" / "best.json").read_text())
        accelerator.unwrap_model(model).load_state_dict(load_file(ckpt_root / "best" / "model.safetensors"))
        print(f"[draftheads] {stage}: kept the step-{best['step']} weights (lowest val_loss {best['val_loss']:.4f})")
        logged = {**logged, "best_step": best["step"], "best_val_loss": best["val_loss"]}
    return logged


def _validate(model, validate, step: int, stage: str, best_dir: Path | None, metrics_path: Path, wandb_run) -> None:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        metrics = validate()
    model.train(was_training)
    with metrics_path.open("a") as f:
        f.write(json.dumps({"stage": stage, "step": step, **metrics}) + "\n")
    if wandb_run is not None:
        wandb_run.log(metrics, step=step)
    if best_dir is None:
        return
    best_file = best_dir / "best.json"
    best = json.loads(best_file.read_text()) if best_file.is_file() else None
    if best is None or metrics["val_loss"] < best["val_loss"]:
        best_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, best_dir / "model.safetensors")
        best_file.write_text(json.dumps({"step": step, "val_loss": metrics["val_loss"]}))  # written last


def validation_fn(step_fn_for: Callable, holdout, batch_size: int, k: int) -> Callable[[], dict]:
    """() -> {"val_loss", "val_acc_1".., "val_tau_est"}: the stage's own step function over every held-out sequence
    (fixed seeds, so the numbers are comparable across steps). val_tau_est = 1 + sum_k prod_{j<=k} acc_j, the τ
    greedy decoding would get if teacher-forced agreement were the acceptance (regenerated data: it is)."""
    step_fn = step_fn_for(holdout)
    batches = math.ceil(len(holdout) / batch_size)

    def validate() -> dict:
        loss, accs = 0.0, {}
        for micro in range(batches):
            part, stats = step_fn(micro, 1.0)
            loss += float(part) / batches
            for key, v in stats.items():
                if key.startswith("acc_") and v == v:
                    accs.setdefault(key, []).append(v)
        out = {"val_loss": round(loss, 6)}
        tau, run = 1.0, 1.0
        for d in range(1, k + 1):
            vs = accs.get(f"acc_{d}")
            if not vs:
                break
            out[f"val_acc_{d}"] = round(sum(vs) / len(vs), 4)
            run *= out[f"val_acc_{d}"]
            tau += run
        out["val_tau_est"] = round(tau, 4)
        return out

    return validate


def _save_checkpoint(accelerator, ckpt_root: Path, step: int, keep: int) -> None:
    path = ckpt_root / f"step_{step}"
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        (path / "trainer_state.json").write_text(json.dumps({"step": step}))  # written last = complete marker
        done = sorted((p for p in ckpt_root.glob("step_*") if (p / "trainer_state.json").is_file()),
                      key=lambda p: int(p.name.split("_")[1]))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _truncate_metrics(path: Path, stage: str, step: int) -> None:
    """After a resume, drop the lines a killed run logged past the checkpoint (they are about to be redone)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if not (json.loads(ln).get("stage") == stage and json.loads(ln)["step"] > step)]
    path.write_text("".join(ln + "\n" for ln in kept))


# ---------------------------------------------------------------------------------------------
# stage 1: soft labels
# ---------------------------------------------------------------------------------------------
def draft_labels(target, head, batch: dict, out, chunk: slice):
    """Target logits [n, V_draft] (no grad) and token labels [n] (draft-vocab ids, -1 outside) for rows `chunk`."""
    b, rows = out.batch_index[chunk], (out.anchor + out.depth)[chunk]  # target row t+d predicts token t+d+1
    ids = head.draft_ids
    final = batch["final_hidden"][b, rows].to(target.dtype)
    with torch.no_grad():  # the target restricted to the draft vocabulary: only those rows of its LM head (N/V the cost)
        lm = target.model.get_output_embeddings()
        tgt = lm(final) if ids is None else F.linear(final, lm.weight[ids], None if lm.bias is None else lm.bias[ids])
    labels = batch["input_ids"][b, rows + 1]
    if ids is not None:
        draft_index = torch.cumsum(head.t2d.long(), 0) - 1
        labels = torch.where(head.t2d[labels], draft_index[labels], torch.full_like(labels, -1))
    return tgt, labels


def soft_label_step_fn(head, target, dataset, tc, k: int, device):
    gamma = tc.position_gamma or k

    def step_fn(micro: int, temperature: float):
        items = [dataset[i] for i in batch_indices(micro, tc.batch_size, len(dataset), tc.seed)]
        batch = collate(items, device)
        g = torch.Generator().manual_seed(tc.seed * 1_000_003 + micro)
        if _unwrap(head).family_name in BLOCK_FAMILIES:
            plan = anchor_plan(batch["loss_mask"].cpu(), batch["lengths"].cpu(), k, tc.anchors_per_sequence, g)
        else:
            plan = cod_plan(batch["loss_mask"].cpu(), batch["lengths"].cpu(), k, tc.cod_decay, g)
        plan = type(plan)(**{f: (v.to(device) if isinstance(v, Tensor) else v) for f, v in vars(plan).items()})
        core = _unwrap(head)
        out = head(batch, plan)  # through the (possibly distributed) wrapper
        n = out.hidden.shape[0]
        w = position_weights(out.depth, tc.position_weighting, gamma)
        total = out.hidden.sum() * 0.0  # keeps the graph when a micro-batch has no labelled rows
        agree = torch.zeros(n, device=device)
        for s in range(0, n, LOSS_CHUNK_ROWS):
            chunk = slice(s, s + LOSS_CHUNK_ROWS)
            tgt, labels = draft_labels(target, core, batch, out, chunk)
            ref = _regression_target(core, batch, out, chunk, tc)
            part, hit = _chunk_loss(core, out.hidden[chunk], out.depth[chunk], tgt, labels, w[chunk], tc, temperature,
                                    ref)
            total = total + part
            agree[chunk] = hit
        loss = total / w.sum().clamp(min=1e-6)
        stats = {"tokens": int(batch["lengths"].sum())}
        for d in range(1, k + 1):
            sel = out.depth == d
            stats[f"acc_{d}"] = float(agree[sel].mean()) if sel.any() else float("nan")
        return loss, stats

    return step_fn


def _regression_target(core, batch: dict, out, chunk: slice, tc) -> Tensor | None:
    """The target's LM-head input at each row's label position (train.hidden_weight > 0), for heads whose output
    rows are their own LM-head input (P-EAGLE, EAGLE-3); None when the term is off."""
    if tc.hidden_weight <= 0:
        return None
    final = batch["final_hidden"][out.batch_index[chunk], (out.anchor + out.depth)[chunk]]
    if final.shape[-1] != out.hidden.shape[-1] or core.family_name not in ("peagle", "eagle3"):
        raise DraftheadsError(f"train.hidden_weight={tc.hidden_weight} regresses the head's LM-head input onto the "
                              f"target's; a {core.family_name} head has no such state. Set train.hidden_weight=0")
    return final


def _chunk_loss(core, hidden, depth, tgt, labels, w, tc, temperature, ref=None):
    """Weighted loss sum of one chunk; logits are recomputed in backward (checkpoint) so only one chunk is alive.
    ref: the target's LM-head input per row for hidden-state regression (EAGLE's SmoothL1 feature loss), or None."""
    def f(h):
        logits = core.logits_for(h, depth)
        per = tc.distill_weight * distill_loss(tc.loss, tgt, logits, temperature, tc.lk_tv_weight)
        if ref is not None:
            per = per + tc.hidden_weight * F.smooth_l1_loss(h.float(), ref.float(), reduction="none").mean(-1)
        if tc.ce_weight > 0:
            per = per + tc.ce_weight * token_ce(logits, labels)
        if tc.confidence_weight > 0 and hasattr(core, "confidence_logit"):  # DSpark: c_k learns 1 - TV_k
            survive = 1.0 - total_variation(tgt, logits, temperature).detach()
            c_logit = core.confidence_logit(h, depth).float()
            per = per + tc.confidence_weight * F.binary_cross_entropy_with_logits(c_logit, survive, reduction="none")
        return (per * w).sum(), (logits.argmax(-1) == tgt.argmax(-1)).float()

    if hidden.requires_grad:
        part, hit = torch.utils.checkpoint.checkpoint(f, hidden, use_reentrant=False)
    else:
        part, hit = f(hidden)
    return part, hit.detach()


def _unwrap(model):
    return getattr(model, "module", model)


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def train_draft(cfg, target, features, out_dir, stop_at_step: int | None = None) -> Path:
    """Run cfg.train.stages; the final head is written with models/checkpoint.py to out_dir/head."""
    from omegaconf import OmegaConf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dc, tc = cfg.draft, cfg.train
    bad = [s for s in tc.stages if s not in STAGES]
    if bad or not tc.stages:
        raise DraftheadsError(f"train.stages {list(tc.stages)} must be a non-empty list of {list(STAGES)}")
    dataset, holdout = split_holdout(open_features(features, target), tc.holdout_sequences)
    resolved = OmegaConf.to_yaml(cfg, resolve=True) if OmegaConf.is_config(cfg) else None
    torch.manual_seed(tc.seed)
    wandb_run = _wandb(cfg, out) if tc.wandb else None
    metrics_path = out / "metrics.jsonl"
    cpu = target.device.type == "cpu"
    head, metrics = None, {}

    if "soft_label" in tc.stages:
        stage_dir = out / "head_soft_label"
        if (stage_dir / "config.json").is_file() and tc.resume:
            print(f"[draftheads] soft_label: already done ({stage_dir})")
            head = _trainable(load_draft(stage_dir, target))
        else:
            head = _initial_head(dc, target, dataset)
            def step_fn_for(data):
                return soft_label_step_fn(head, target, data, tc, dc.k, target.device)

            step_fn = step_fn_for(dataset)
            validate = None if holdout is None else validation_fn(step_fn_for, holdout, tc.batch_size, dc.k)
            metrics = run_loop(head, step_fn, steps=tc.steps, lr=tc.lr, warmup=tc.warmup_steps,
                               weight_decay=tc.weight_decay, max_grad_norm=tc.max_grad_norm, grad_accum=tc.grad_accum,
                               mixed_precision=tc.mixed_precision, ckpt_root=out / "checkpoints",
                               checkpoint_every=tc.checkpoint_every, log_every=tc.log_every,
                               metrics_path=metrics_path, stage="soft_label", temperature_cfg=tc.temperature,
                               resume=tc.resume, cpu=cpu, wandb_run=wandb_run, stop_at_step=stop_at_step,
                               validate=validate, eval_every=tc.eval_every)
            if stop_at_step is not None and stop_at_step < tc.steps:
                return out  # simulated kill: no final head
            save_draft(head, stage_dir, target, resolved, metrics)

    if "rl" in tc.stages:
        from train.rl import rl_validation_fn, train_rl

        if head is None:  # RL alone: start from draft.init_from (a stage-1 checkpoint)
            if not dc.init_from:
                raise DraftheadsError("train.stages=[rl] needs draft.init_from=DIR (a stage-1 head) to start from")
            head = _trainable(load_draft(dc.init_from, target))
        validate = None
        if holdout is not None:
            tau_est = validation_fn(  # teacher-forced greedy agreement: val_tau_est
                lambda data: soft_label_step_fn(head, target, data, tc, dc.k, target.device), holdout, tc.batch_size,
                dc.k)
            on_policy = rl_validation_fn(head, target, holdout, tc, dc.k, target.device)  # the RL objective at T

            def validate():
                return {**tau_est(), **on_policy()}
        head, metrics = train_rl(cfg, head, target, dataset, out, metrics_path, wandb_run, stop_at_step, validate)
        if head is None:
            return out

    final = save_draft(_unwrap(head), out / "head", target, resolved, metrics)
    if wandb_run is not None:
        wandb_run.finish()
    return final


def _initial_head(dc, target, dataset):
    if not dc.share_embedding:
        raise DraftheadsError("draft.share_embedding=false is not supported: heads read the target's frozen token "
                              "embedding (as vLLM's EAGLE-3 loader does when embed_tokens is absent); set it to true")
    if dc.init_from:  # domain fine-tuning: continue from an existing head (same family/sizes as recorded there)
        return _trainable(load_draft(dc.init_from, target))
    vocab = None
    if dc.draft_vocab_size is not None and dc.draft_vocab_size < target.vocab_size:
        vocab = build_draft_vocab((dataset[i] for i in range(len(dataset))), dc.draft_vocab_size, target.vocab_size)
    return build_draft(dc.family, target, dc.k, dc.num_layers, dc.parallel, vocab, dc.share_lm_head, dict(dc.extra))


def _trainable(head):
    head.train()
    for name, p in head.named_parameters():
        p.requires_grad_(True)
    return head


def _wandb(cfg, out: Path):
    try:
        import wandb
    except ImportError:
        raise DraftheadsError("train.wandb=true needs the wandb package: `pip install wandb` "
                              "(or set train.wandb=false; metrics.jsonl is always written)") from None
    os.environ.setdefault("WANDB_MODE", "offline")  # no network here: sync later with `wandb sync`
    from omegaconf import OmegaConf

    return wandb.init(project=cfg.train.wandb_project, name=str(cfg.get("name", "draft")), dir=str(out),
                      config=OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else None)
