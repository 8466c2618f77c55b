"""Entry point: `python -m train.distill +experiment=NAME [overrides]`.

One run = resolve the target (fail fast if it is not available) → data stage (read, regenerate, tokenize,
extract features) → training stages (soft labels, then acceptance-rate RL) → τ table on held-out prompts.
Every stage resumes from what is already in the run's output directory.

`accelerate.num_processes > 1` (or `+experiment=peagle_70b`): the command re-executes itself under torchrun with the
same arguments (train/distributed.py); the data stage and every file are the main process's, training is every rank's.
`train.dry_run=true` prints the memory and data plan (train/plan.py) without loading weights.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from pathlib import Path

from inference.host_memory import policy as malloc_policy
from inference.host_memory import run_under_mimalloc

if __name__ == "__main__":
    run_under_mimalloc()  # first: the re-execution repeats every import made before it (torch's take seconds)

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from conf.schema import check_config, register_configs
from models.checkpoint import read_draft_config
from models.errors import DraftheadsError
from models.files import check_writable, exclusive
from models.families import family

register_configs()


def run(cfg: DictConfig) -> dict:
    """One run in this process (one rank of N when launched by torchrun): the main process writes every file.

    The target is loaded onto this rank's device only after the process group exists, and only as much of it as the
    work needs: its embedding, norm and LM head to train from offline features or to prepare data it does not run on
    (a server regenerates, features are online); all of it to regenerate or extract here, online features, RL and
    evaluation, with decoder layers FSDP2-sharded over the ranks under accelerate=fsdp / zero3. The data
    stage and the τ table split their work over the processes."""
    from accelerate.utils import gather_object

    from data.prepare import Workers, data_settings, prepare_data, ready_report, weights_identity
    from eval.tau_table import evaluate, log_tau, source_label
    from inference.threads import available_threads
    from models.target import load_target
    from train.distributed import die_with_launcher, make_accelerator, resolve_mixed_precision
    from train.trainer import open_wandb, train_draft

    die_with_launcher()
    cfg.train.mixed_precision = resolve_mixed_precision(cfg.train.mixed_precision, cfg.runtime.device)
    accelerator = make_accelerator(cfg.accelerate, cfg.train, cfg.runtime.device)  # the process group exists from here
    main, world = accelerator.is_main_process, accelerator.num_processes
    workers = Workers(accelerator.process_index, world, accelerator.wait_for_everyone, gather_object)
    # the machine's cores, shared by its processes (runtime.threads=0: the ones nothing else keeps busy)
    threads = max(1, available_threads(cfg.runtime.threads) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.train.seed)
    out, d = Path(cfg.output_dir), cfg.data
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    sharded = cfg.accelerate.strategy in ("fsdp", "zero3") and world > 1
    t = cfg.target

    def load(parts: str = "all", shard: bool = sharded):
        return load_target(t.name, t.path, t.layer_ids, t.dtype, str(accelerator.device), parts=parts, shard=shard)

    target = load("head_inputs")
    if main:
        print(f"[draftheads] target {target.name}: {target.num_layers} layers, hidden {target.hidden_size}, "
              f"vocab {target.vocab_size}, features from layers {list(target.layer_ids)}; "
              f"{world} process(es) x {threads} thread(s), strategy {cfg.accelerate.strategy}; "
              f"malloc: {malloc_policy()}")
    weights = weights_identity(t.path, t.dtype)
    settings = data_settings(d, target.fingerprint, cfg.train.seed, weights)
    data_dir, regenerated = data_directory(cfg, out, settings, main)
    with cache_lock(regenerated and regenerated.parent.parent, workers):  # runs sharing a cache: one at a time
        report = {"data": ready_report(data_dir, settings)}
        if report["data"] is None:
            if sharded and d.regenerate and d.regen_backend == "runtime":
                raise DraftheadsError("the built-in runtime cannot regenerate with a sharded target; set "
                                      "data.regen_backend=openai (a vLLM / SGLang server at data.regen_server) or "
                                      "prepare the data with accelerate=ddp first")
            if sharded and d.features == "offline":  # ranks extract blocks of different sizes; forwards are collective
                raise DraftheadsError("data.features=offline cannot be extracted with a sharded target (accelerate="
                                      f"{cfg.accelerate.strategy}, {world} processes): ranks extract blocks of "
                                      "different sizes and every forward of a sharded target gathers over all of "
                                      "them, so they would wait on each other until the timeout. Set "
                                      "data.features=online (the target runs sharded in each step), or extract them "
                                      "first with accelerate=ddp on devices that hold the whole target, then rerun")
            if d.features == "offline" or (d.regenerate and d.regen_backend == "runtime"):
                target = load()  # the target runs here; a server's regeneration and online data need its tokenizer
            report["data"] = prepare_data(target, data_dir, d, cfg.train.seed, workers, regenerated, weights)
        elif main:
            print(f"[draftheads] data: ready in {data_dir} (same settings: {report['data']['settings']['sha256']})")
    if main:
        print("[draftheads] data:", json.dumps({k: v for k, v in report["data"].items() if k != "settings"}))
    sources = [(source_label(spec), spec) for spec in cfg.eval.sources]
    if cfg.draft.init_from and cfg.eval.compare_init:  # a fine-tune: the head it started from, on the same prompts
        sources.append(("head_before", f"head:{cfg.draft.init_from}"))
    wandb_run = open_wandb(cfg, out) if cfg.train.wandb and main else None
    if cfg.train.stages and d.features != "none":
        if d.features == "online" or "rl" in cfg.train.stages:  # the target runs in the step
            target = target if target.parts == "all" else load()
        elif target.parts == "all":
            target = load("head_inputs")  # offline: free the decoder layers before training
        report["head"] = str(train_draft(cfg, target, data_dir / "features", out, accelerator=accelerator,
                                         wandb_run=wandb_run))
        trained = [("head", f"head:{report['head']}")]
        if cfg.eval.head_tree and family(read_draft_config(report["head"])["family"]).tree:
            trained.append(("head[tree=1]", f"head:{report['head']},tree=1"))
        sources = trained + sources  # the trained head's rows first: a table cut short still has them
    if cfg.eval.limit != 0 and sources:
        if sharded:
            if main:
                print("[draftheads] eval: skipped (the target is sharded; measure the exported head with a serving "
                      "engine, or rerun the τ table with eval.acceptance on one device)")
        else:  # every process answers its share of the prompts
            report["eval"] = evaluate(cfg, sources, out / "eval", target if target.parts == "all" else
                                      load(shard=False), workers, threads)
    if main:
        report["malloc"] = malloc_policy()  # the allocator training ran with (inference/host_memory.py)
        (out / "run_report.json").write_text(json.dumps(report, indent=1))
        if wandb_run is not None:  # the sweep's metric, logged before the run closes
            log_tau(wandb_run, report.get("eval", []))
            wandb_run.finish()
        print(f"[draftheads] outputs in {out}/")
    accelerator.wait_for_everyone()
    return report


def data_directory(cfg, out: Path, settings: dict, main: bool) -> tuple[Path, Path | None]:
    """Where this run's data lives and where its regenerated text goes (None: inside the data directory): out/data,
    or, when runs share data (data.cache_dir, or the points of a Hydra multirun by default), CACHE/<hash of the data
    settings> with out/data linking to it, and CACHE/regenerated/<hash of the regeneration settings>.jsonl: runs that
    differ only in training settings regenerate and extract once; heads reading other target layers (DSpark's five,
    P-EAGLE's three) share the regeneration and extract their own features."""
    cache = cfg.data.cache_dir
    if cache is None and multirun():
        from hydra.core.hydra_config import HydraConfig

        cache = str(Path(HydraConfig.get().sweep.dir) / "data")
    if cache is None:
        return out / "data", None
    shared = Path(cache).resolve() / settings["sha256"]
    link = out / "data"
    if main:
        shared.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and link.resolve() != shared:
            link.unlink()
        if not link.exists():
            link.symlink_to(shared, target_is_directory=True)
    return shared, Path(cache).resolve() / "regenerated" / f"{settings['regen_sha256']}.jsonl"


@contextlib.contextmanager
def cache_lock(cache: Path | None, workers):
    """Runs that share data.cache_dir (W&B agents side by side, runs on one machine) prepare data one at a time: the
    main process holds CACHE/.lock through the data stage, its other ranks wait for it at a barrier, and a run that
    waited finds the data ready. No cache: nothing to share."""
    if cache is None:
        yield
        return
    if workers.rank != 0:
        workers.wait()
        yield
        return
    with exclusive(cache / ".lock", lambda: print(f"[draftheads] data: another run is preparing data in {cache}; "
                                                  "waiting for it (its data may be this run's)", flush=True)):
        workers.wait()
        yield


def multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


WRITE_FAILURES = ("No space left on device", "code: 28", "iostream error", "unexpected pos",
                  "PytorchStreamWriter failed")  # ENOSPC as safetensors' and torch.save's own errors word it


def disk_full(e: BaseException | None) -> bool:
    """A full disk, as OSError(ENOSPC) or wrapped by safetensors / torch.save (checked down the exception chain)."""
    while e is not None:
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or any(w in str(e) for w in WRITE_FAILURES):
            return True
        e = e.__cause__ or e.__context__
    return False


def disk_full_message(e: BaseException, out: Path) -> str:
    """Where the disk filled up, how much is free, and that a rerun resumes (every progress file is written
    atomically or appended, so nothing written before the failure is lost)."""
    where = getattr(e, "filename", None) or out
    free = shutil.disk_usage(out if out.exists() else Path.cwd()).free
    return (f"the disk is full while writing '{where}' ({free / 2**20:.1f} MiB free on {out}'s filesystem); free "
            f"space (data/features need about data.shard_mb per shard, checkpoints about 16 bytes per head "
            f"parameter) and rerun the same command: it resumes where it stopped")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from train.distributed import relaunch

    try:
        named_out = any(o.split("=")[0].lstrip("+") == "output_dir" for o in HydraConfig.get().overrides.task)
        if multirun() and not named_out:
            cfg.output_dir = HydraConfig.get().runtime.output_dir  # each point of a sweep in its own directory
        elif os.environ.get("WANDB_SWEEP_ID") and not named_out:  # a W&B agent's run: one directory per run
            cfg.output_dir = f"outputs/sweeps/{os.environ['WANDB_SWEEP_ID']}/{os.environ.get('WANDB_RUN_ID', 'run')}"
        check_config(cfg)
        if cfg.train.dry_run:  # the plan for the configured processes and devices, from this one process
            from train.plan import print_plan

            print_plan(cfg)
            return
        if cfg.runtime.device == "cuda" and not torch.cuda.is_available():
            raise DraftheadsError("runtime.device=cuda but this machine has no CUDA device; use runtime=cpu")
        # more than one process asked for: exec torchrun over these arguments, the workers in this run's Hydra dir
        check_writable(cfg.output_dir, "output_dir", directory=True)
        relaunch(cfg.accelerate, sys.argv[1:], HydraConfig.get().runtime.output_dir, cfg.runtime.device)
        run(cfg)
    except DraftheadsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # a full disk surfaces as OSError, or as safetensors' own error around it
        if not disk_full(e):
            raise
        print(f"error: {disk_full_message(e, Path(cfg.output_dir))}", file=sys.stderr)
        sys.exit(2)


def output_dir_from_argv(argv: list[str]) -> Path:
    """The output_dir a command line names (Hydra creates its run directory inside it before any code of ours runs),
    or the default's parent: checked before Hydra starts so an unwritable one is a clear error, not a traceback."""
    named = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == "output_dir" and "=" in a]
    return Path(named[-1]) if named and "${" not in named[-1] else Path("outputs")


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    try:
        check_writable(output_dir_from_argv(sys.argv[1:]), "output_dir", directory=True)
    except DraftheadsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    main()
