"""The training loop every stage runs (soft labels, RL), written once for N processes.

A stage supplies a `Stage`: its name, steps, learning rate and `step_fn(model, micro, temperature) -> (loss, stats)`,
optionally `validate(model, shard) -> metrics`. A stage may report `data_s` (seconds spent reading its batch) in its
stats: each logged row then says where an optimizer step went (data_ms, forward_ms, backward_ms, optimizer_ms).
The loop owns the rest: AdamW, the learning rate (warmup then cosine,
a pure function of the optimizer step, so nothing can step it twice), gradient accumulation and mixed precision
through the accelerator, logging (metrics.jsonl and W&B, main process only, every value averaged over ranks),
validation, the best-weights file, and checkpoints that resume exactly.

Data position is a pure function of the micro-batch index: at optimizer step s, accumulation slot a, rank r of W,
the step reads global micro-batch g = (s * grad_accum + a) * W + r (batch order and COD sampling are seeded by g).
Ranks read disjoint batches, and W processes at grad_accum A read, per optimizer step, exactly the batches one process
reads at grad_accum W * A: the two runs follow the same curve (tests/test_multiprocess.py). Resuming needs only the
step number; model, optimizer and per-rank RNG states come back through accelerator.save_state / load_state.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from inference.host_memory import release_freed_memory
from models.errors import DraftheadsError
from models.files import fsync_tree, save_tensors, write_atomic
from train.distributed import as_main_sees_it
from train.temperature import temperature_at

SUMMED = ("tokens", "val_blocks")  # stats added up over micro-batches and ranks; every other one is averaged


class Tally:
    """Named sums and counts: a stat is `value` (count 1) or `(sum, count)`; NaN means "no data here"."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, key: str, value, count: float = 1.0) -> None:
        if isinstance(value, tuple):
            value, count = value
        value = float(value)
        if value != value or count == 0:
            return
        self.sums[key] = self.sums.get(key, 0.0) + value
        self.counts[key] = self.counts.get(key, 0.0) + count

    def update(self, stats: dict) -> None:
        for key, value in stats.items():
            self.add(key, value)

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] if k in SUMMED else self.sums[k] / self.counts[k] for k in sorted(self.sums)}


@dataclass
class Shard:
    """This process's part of a job split over ranks, and how the parts meet (sum of Tallies over ranks)."""
    rank: int = 0
    world: int = 1
    reduce: Callable[[Tally], dict] = Tally.means

    def calls(self, n: int):
        """(index, real) for this rank's share of n equal work items, round-robin. Every rank makes the same number
        of calls (a sharded or data-parallel forward is collective); a rank past the end repeats item 0, not counted."""
        for i in range(math.ceil(n / self.world)):
            j = i * self.world + self.rank
            yield (j, True) if j < n else (0, False)


def shard_of(accelerator) -> Shard:
    if accelerator is None or accelerator.num_processes == 1:
        return Shard()
    return Shard(accelerator.process_index, accelerator.num_processes, lambda t: reduce_tally(accelerator, t))


def reduce_tally(accelerator, tally: Tally) -> dict[str, float]:
    """Sum every rank's sums and counts (keys: the union over ranks) and return the means."""
    from accelerate.utils import gather_object

    keys = sorted(set().union(*gather_object([sorted(tally.sums)])))
    packed = torch.tensor([[tally.sums.get(k, 0.0), tally.counts.get(k, 0.0)] for k in keys], dtype=torch.float64,
                          device=accelerator.device).reshape(-1, 2)
    packed = accelerator.reduce(packed, reduction="sum")
    total = Tally()
    for k, (s, c) in zip(keys, packed.tolist()):
        if c:
            total.sums[k], total.counts[k] = s, c
    return total.means()


@dataclass
class Stage:
    name: str  # "soft_label" | "rl": the metrics' stage column and the checkpoint directory
    steps: int  # optimizer steps
    lr: float
    warmup: int
    step_fn: Callable[[nn.Module, int, float], tuple[Tensor, dict]]  # (model, global micro-batch, T) -> loss, stats
    ckpt_root: Path
    validate: Callable | None = None  # (model, Shard) -> metrics (identical on every rank), or None
    keep_best: bool = True  # keep the best validated weights (stage 1); RL only logs validation, step 0 included
    keep_best_by: str = "val_loss"  # val_loss (lowest) or a τ metric (highest) of the validation's output
    steps_option: str = "train.steps"  # the option that sets `steps`, for messages
    settings: dict = field(default_factory=dict)  # what shapes the weights (train.trainer.stage_settings)
    anneals: bool = True  # step_fn reads the distillation T schedule, logged as `temperature` (RL serves at its own)


@dataclass
class RunLog:
    """metrics.jsonl, and W&B when a run is given; written by the main process only. W&B steps count on across
    stages (a stage's step 0 follows the last step logged before it: W&B drops steps below its current one) so one
    run shows both."""
    path: Path
    main: bool
    wandb_run: object = None
    offsets: dict = field(default_factory=dict)
    top: int = -1  # the highest W&B step logged

    def resume(self, stage: str, step: int) -> None:
        """Drop what a killed run logged for `stage` past its checkpoint `step` (about to be redone) and a torn last
        line; the file is replaced atomically, never rewritten in place."""
        if not self.main or not self.path.exists():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1  # a last line without its newline is torn, even when it parses
        lines = [line for line in data[:end].split(b"\n") if line]
        kept = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a damaged line
            if not (row.get("stage") == stage and row.get("step", 0) > step):
                kept.append(line)
        if len(kept) != len(lines) or end != len(data):
            write_atomic(self.path, b"".join(line + b"\n" for line in kept))

    def restart(self, stage: str) -> None:
        """A stage starting from step 0 (no checkpoint): none of its earlier lines stand (step-0 validation included)."""
        self.resume(stage, -1)

    def write(self, row: dict) -> None:
        if not self.main:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            offset = self.offsets.setdefault(row["stage"], self.top + 1)
            self.top = max(self.top, offset + row["step"])
            self.wandb_run.log({f"{row['stage']}/{k}": v for k, v in row.items() if k not in ("stage", "step")},
                               step=offset + row["step"])


def lr_factor(step: int, warmup: int, steps: int, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine down to `floor` at `steps`."""
    if step < warmup:
        return (step + 1) / warmup
    x = (step - warmup) / max(1, steps - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(x, 1.0)))


def newest_checkpoint(root: Path) -> tuple[int, Path | None]:
    """(step, directory) of the newest complete checkpoint, (0, None) without one: its trainer_state.json (written
    last, atomically) names its step."""
    done = []
    for p in root.glob("step_*"):
        try:
            done.append((json.loads((p / "trainer_state.json").read_text())["step"], p))
        except (OSError, ValueError, KeyError):
            continue  # no marker (or a damaged one): the save never finished
    return max(done, key=lambda sp: sp[0], default=(0, None))


def check_steps(done: int, steps: int, where, option: str) -> None:
    """A stage trained `done` steps (its newest checkpoint at `where`) cannot stop at fewer: returning those weights
    as a `steps`-step result would mislabel them."""
    if done > steps:
        raise DraftheadsError(f"'{where}' is at step {done}, past the {steps} steps asked for ({option}={steps}); set "
                              f"{option} to {done} or more to resume, train.resume=false to start the stage over, or "
                              "use another output_dir")


def check_settings(path: Path, settings: dict, what: str, ignore: tuple = ()) -> None:
    """Raise naming the differences when the settings recorded at `path` are not `settings` (but for the keys in
    `ignore`). An option the recording lacks (it was added later) counts as its default, so a finished run still
    resumes under newer code; another missing entry (e.g. the process count) is unknown and not compared."""
    from omegaconf import OmegaConf

    from conf.schema import Config

    settings = {k: v for k, v in settings.items() if k not in ignore}
    try:
        recorded = {k: v for k, v in json.loads(path.read_text()).items() if k not in ignore}
    except (ValueError, AttributeError):  # truncated or not a JSON object
        raise DraftheadsError(f"'{path}' (the settings of {what}) is damaged; restore it, set train.resume=false to "
                              "start over, or use another output_dir") from None
    defaults = OmegaConf.structured(Config)
    recorded |= {k: OmegaConf.select(defaults, k, default=settings[k]) for k in set(settings) - set(recorded)}
    keys = sorted(set(recorded) | set(settings))
    diff = [f"{k}: {recorded.get(k)!r} there, {settings.get(k)!r} now" for k in keys if recorded.get(k) != settings.get(k)]
    if diff:
        raise DraftheadsError(f"{what} came from other settings ({'; '.join(diff[:4])}); rerun with the same "
                              "settings to resume, set train.resume=false to start over, or use another output_dir")


def check_or_record_settings(root: Path, settings: dict, main: bool, resume: bool, wait=lambda: None,
                             once=lambda compute: compute()) -> None:
    """A resume is only a resume: checkpoints made with other weight-shaping settings are an error that names the
    difference. train.resume=false starts over: the stage's earlier checkpoints and best weights are removed (by the
    main process; `wait`, a barrier, keeps the others from checking what it is removing). `once` runs the check on
    the main process alone and gives its outcome, error included, to every rank (distributed.as_main_sees_it)."""
    path = root / "settings.json"
    if not resume and main and root.exists():
        print(f"[draftheads] train.resume=false: removing the earlier checkpoints in {root}")
        shutil.rmtree(root)
    wait()

    def check_or_record():
        if path.is_file():
            check_settings(path, settings, f"the checkpoints in '{root}'")
        elif main:
            root.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(settings, indent=1, sort_keys=True).encode())
    once(check_or_record)


def run_stage(accelerator, model: nn.Module, stage: Stage, tc, log: RunLog, stop_at_step: int | None = None):
    """Train `model` for stage.steps optimizer steps. Returns (finished, state, metrics): finished is False after a
    simulated kill (stop_at_step); state is the head's full state dict on the main process (None elsewhere), the
    best-validation weights when stage.keep_best found any; metrics are the last logged ones."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=stage.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    model, optimizer = accelerator.prepare(model, optimizer)
    shard, main, A = shard_of(accelerator), accelerator.is_main_process, tc.grad_accum
    check_or_record_settings(stage.ckpt_root, stage.settings, main, tc.resume, accelerator.wait_for_everyone,
                             once=lambda compute: as_main_sees_it(accelerator, compute))

    done, last = as_main_sees_it(accelerator, lambda: newest_checkpoint(stage.ckpt_root))
    check_steps(done, stage.steps, last, stage.steps_option)
    step = 0
    if last is not None:
        states = last / f"random_states_{accelerator.process_index}.pkl"  # every strategy writes one per rank
        if not states.is_file():
            raise DraftheadsError(f"checkpoint '{last}' is incomplete ('{states.name}' is missing), so it cannot "
                                  "resume exactly; delete that directory to resume from the checkpoint before it, or "
                                  "set train.resume=false to start the stage over")
        try:
            accelerator.load_state(str(last))
        except Exception as e:  # a truncated or garbled model / optimizer file of a killed or damaged run
            raise DraftheadsError(f"checkpoint '{last}' cannot be read ({type(e).__name__}: {str(e)[:200]}); delete "
                                  "that directory to resume from the checkpoint before it, or set "
                                  "train.resume=false to start the stage over") from None
        step = json.loads((last / "trainer_state.json").read_text())["step"]
        if main:
            print(f"[draftheads] {stage.name}: resumed from {last} (step {step})")
    accelerator.step = step * A  # where accelerate's accumulation counter stands (sync on every A-th micro-step)
    if step:
        log.resume(stage.name, step)
    else:
        log.restart(stage.name)
    best = as_main_sees_it(accelerator, lambda: _read_best(stage.ckpt_root) if stage.keep_best else None)
    if best is not None and best.get("by", "val_loss") != stage.keep_best_by:
        raise DraftheadsError(f"the best weights kept in '{stage.ckpt_root / 'best'}' were chosen by "
                              f"{best.get('by', 'val_loss')}, this run would choose by {stage.keep_best_by} "
                              "(train.keep_best_by / train.val_tau_chain changed): set them back to resume, or set "
                              "train.resume=false to start the stage over")
    if best is not None and best["step"] > step:  # kept by the killed run past where this one resumes: it validates
        best = None  # those steps again, so the kept weights are always this run's
        if main:
            shutil.rmtree(stage.ckpt_root / "best", ignore_errors=True)
    if stage.validate is not None and not stage.keep_best and step == 0:
        log.write({"stage": stage.name, "step": 0, **_validate(model, stage, shard)})

    from tqdm import tqdm

    bar = tqdm(total=stage.steps, initial=step, desc=stage.name, disable=not main)
    try:
        step, logged = _steps(accelerator, model, optimizer, stage, tc, log, shard, step, best, bar, stop_at_step)
    finally:
        bar.close()  # also on an error: the bar's last line must not print after the error message
    if step < stage.steps:
        return False, None, logged
    best = as_main_sees_it(accelerator, lambda: _read_best(stage.ckpt_root) if stage.keep_best else None)
    if best is not None:
        if main:
            key = best.get("by", "val_loss")
            print(f"[draftheads] {stage.name}: kept the step-{best['step']} weights "
                  f"({'lowest' if key == 'val_loss' else 'highest'} {key} {best[key]:.4f})")
        from safetensors.torch import load_file

        state = load_file(stage.ckpt_root / "best" / best.get("file", "model.safetensors")) if main else None
        kept = {f"best_{k}": v for k, v in best.items() if k.startswith("val_")}
        return True, state, {**logged, "best_step": best["step"], **kept}
    return True, _full_state(accelerator, model), logged


def clock(device: torch.device) -> float:
    """time.perf_counter() once the device has run what was queued: a step's phase times, also on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _steps(accelerator, model, optimizer, stage: Stage, tc, log: RunLog, shard: Shard, step: int, best, bar,
           stop_at_step):
    """The optimizer steps from `step` to stage.steps (or a simulated kill): returns (step reached, last metrics)."""
    A = tc.grad_accum
    window, logged, t0 = Tally(), {}, time.perf_counter()
    sleep = float(os.environ.get("DRAFTHEADS_TEST_STEP_SLEEP", "0"))  # tests: widen the window a kill can land in
    while step < stage.steps:
        temperature = temperature_at(step, tc.temperature.start, tc.temperature.end, tc.temperature.schedule,
                                     tc.temperature.steps or stage.steps)
        lr = stage.lr * lr_factor(step, stage.warmup, stage.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss = 0.0
        for a in range(A):
            micro = (step * A + a) * shard.world + shard.rank
            with accelerator.accumulate(model):
                t = [clock(accelerator.device)]
                loss, stats = stage.step_fn(model, micro, temperature)  # data (reported by the stage) + forward
                t.append(clock(accelerator.device))
                accelerator.backward(loss)
                t.append(clock(accelerator.device))
                if accelerator.sync_gradients and tc.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), tc.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
                t.append(clock(accelerator.device))
            step_loss += float(loss.detach()) / A
            data_s = stats.pop("data_s", 0.0)
            window.update({**stats, "data_ms": 1e3 * data_s * A, "forward_ms": 1e3 * (t[1] - t[0] - data_s) * A,
                           "backward_ms": 1e3 * (t[2] - t[1]) * A, "optimizer_ms": 1e3 * (t[3] - t[2]) * A})
        step += 1
        mean_loss = float(accelerator.reduce(torch.tensor(step_loss, device=accelerator.device), reduction="mean"))
        if not math.isfinite(mean_loss):
            raise DraftheadsError(f"{stage.name}: the loss is {mean_loss} at step {step}; nothing was saved past the "
                                  f"last checkpoint. Lower train.lr (now {stage.lr:g}) or check the features")
        window.add("loss", mean_loss)
        bar.update(1)
        if step % tc.log_every == 0 or step == stage.steps:
            means = shard.reduce(window)
            elapsed = time.perf_counter() - t0
            logged = {"stage": stage.name, "step": step, "loss": round(means.pop("loss"), 6), "lr": lr,
                      **({"temperature": round(temperature, 4)} if stage.anneals else {}),
                      "tokens_per_s": round(means.pop("tokens", 0) / max(elapsed, 1e-9), 1),
                      **{k: round(v, 1 if k.endswith("_ms") else 4) for k, v in means.items()}}
            log.write(logged)
            release_freed_memory()  # what this window's shapes left in the heap (inference/host_memory.py)
            bar.set_postfix(loss=logged["loss"])
            window, t0 = Tally(), time.perf_counter()
        paused = time.perf_counter()  # validation and checkpoints are not training: tokens_per_s leaves them out
        if stage.validate is not None and (step % tc.eval_every == 0 or step == stage.steps):
            metrics = _validate(model, stage, shard)
            log.write({"stage": stage.name, "step": step, **metrics,
                       "val_s": round(time.perf_counter() - paused, 2)})
            key = stage.keep_best_by
            if stage.keep_best and _better(metrics, best, key):
                best = {"step": step, "by": key, **{k: v for k, v in metrics.items() if k in ("val_loss", key)}}
                _save_best(accelerator, model, stage.ckpt_root / "best", best)
        if step % tc.checkpoint_every == 0 or step == stage.steps:
            _save_checkpoint(accelerator, stage.ckpt_root, step)
        t0 += time.perf_counter() - paused
        if sleep:
            time.sleep(sleep)
        if stop_at_step is not None and step >= stop_at_step:  # tests: simulate a kill after this step
            break
    return step, logged


# ---------------------------------------------------------------------------------------------
def _validate(model, stage: Stage, shard: Shard) -> dict:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        metrics = stage.validate(model, shard)
    model.train(was_training)
    return metrics


def _full_state(accelerator, model) -> dict | None:
    """The head's whole state dict on the main process (gathered from shards under FSDP / ZeRO-3), CPU tensors."""
    state = accelerator.get_state_dict(model)  # collective: every rank calls it
    if not accelerator.is_main_process:
        return None
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def _better(metrics: dict, best: dict | None, key: str) -> bool:
    """metrics beat the kept weights by `key`: lower val_loss, or a higher τ."""
    if best is None or key not in best:
        return True
    return metrics[key] < best[key] if key == "val_loss" else metrics[key] > best[key]


def _read_best(root: Path) -> dict | None:
    """The best checkpoint's record; a missing or damaged one (the save never finished) counts as none. It names its
    weights file (model_step{N}.safetensors; older records: model.safetensors), so a kill between a new weights
    file and its record leaves the old record with its own weights."""
    try:
        best = json.loads((root / "best" / "best.json").read_text())
    except (OSError, ValueError):
        return None
    complete = isinstance(best, dict) and {"step", "val_loss"} <= best.keys()
    return best if complete and (root / "best" / best.get("file", "model.safetensors")).is_file() else None


def _save_best(accelerator, model, best_dir: Path, best: dict) -> None:
    state = _full_state(accelerator, model)
    if state is not None:
        best_dir.mkdir(parents=True, exist_ok=True)
        best["file"] = f"model_step{best['step']}.safetensors"
        save_tensors(best_dir / best["file"], state)
        write_atomic(best_dir / "best.json", json.dumps(best).encode())  # written last: marks the weights complete
        for old in best_dir.glob("model*.safetensors"):
            if old.name != best["file"]:
                old.unlink()
    accelerator.wait_for_everyone()


def _save_checkpoint(accelerator, root: Path, step: int, keep: int = 2) -> None:
    path = root / f"step_{step}"
    accelerator.save_state(str(path))  # every rank: sharded strategies write their own shards
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        fsync_tree(path)  # on disk before the marker: a crashed machine must not leave a "complete" empty file
        write_atomic(path / "trainer_state.json", json.dumps({"step": step}).encode())  # the completion marker
        done = sorted((p for p in root.glob("step_*") if (p / "trainer_state.json").is_file()),
                      key=lambda p: int(p.name.split("_")[1]))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
