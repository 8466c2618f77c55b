"""Processes: launching them, the accelerator that joins them, and the parameters a sharded head gathers.

`python -m train.distill ... accelerate=ddp accelerate.num_processes=N` is the one launch command: when it is not yet
running under a launcher it replaces itself (exec) with `torchrun` over the same arguments, so the Hydra `accelerate`
group is the only place the process count and strategy are written. Each worker asks the kernel to kill it when its
launcher dies (kill -9 of the command a user started leaves no orphan training on).

Strategies (conf/accelerate/*.yaml), all through `accelerate.Accelerator`:
  single  one process;
  ddp     every process holds the whole head, gradients are all-reduced (gloo on CPU, NCCL on GPUs);
  fsdp    FSDP2 (fully_shard), one unit per draft decoder layer; GPUs only (accelerate runs CPU groups as ddp);
  zero2   DeepSpeed ZeRO-2: gradients and optimizer states sharded;
  zero3   DeepSpeed ZeRO-3: parameters too; the saved head is one full state dict gathered on the main process.
DeepSpeed also runs on CPU (gloo; DeepSpeed's CPU accelerator, which builds a small C++ op once), so ddp, zero2 and
zero3 are all tested with 2 CPU processes; FSDP is checked by eval/gpu_check.sh.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

from models.errors import DraftheadsError

STRATEGIES = ("single", "ddp", "fsdp", "zero2", "zero3")
DEEPSPEED = ("zero2", "zero3")
# Hydra overrides appended for the workers: the launching process already wrote the run's Hydra directory
WORKER_OVERRIDES = ("hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled")


def launched() -> bool:
    """True inside a process started by torchrun / accelerate launch (they set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ


def check_strategy(ac, device: str) -> None:
    """Clear errors for combinations no launch can satisfy (single values: conf.schema.check_config)."""
    if ac.strategy not in STRATEGIES:
        raise DraftheadsError(f"accelerate.strategy={ac.strategy} must be one of {list(STRATEGIES)}")
    if not 0 <= ac.machine_rank < ac.num_machines:
        raise DraftheadsError(f"accelerate.machine_rank={ac.machine_rank} must be in 0..{ac.num_machines - 1} "
                              f"(accelerate.num_machines={ac.num_machines})")
    if ac.strategy == "single" and ac.num_processes * ac.num_machines > 1:
        raise DraftheadsError(f"accelerate.strategy=single runs one process, not {ac.num_processes * ac.num_machines};"
                              " pick accelerate=ddp (or fsdp, zero2, zero3) or set accelerate.num_processes=1")
    if ac.strategy == "fsdp" and device == "cpu":
        raise DraftheadsError("accelerate.strategy=fsdp shards over GPUs; on CPU accelerate joins processes as plain data "
                              "parallel. Use accelerate=ddp or zero3 with runtime.device=cpu, or runtime=cuda")


def torchrun_command(ac, argv: list[str], run_dir: str) -> list[str]:
    """The torchrun command that starts this run's worker processes on this machine, writing no Hydra files of their
    own (they share the launching process's run directory `run_dir`)."""
    cmd = [sys.executable, "-m", "train.distributed", f"--nproc_per_node={ac.num_processes}"]  # torchrun's main
    if ac.num_machines == 1:
        cmd.append("--standalone")  # a free local port: two runs on one machine do not collide
    else:
        cmd += [f"--nnodes={ac.num_machines}", f"--node_rank={ac.machine_rank}",
                f"--master_addr={ac.main_process_ip}", f"--master_port={ac.main_process_port}"]
    worker = [*WORKER_OVERRIDES, f"hydra.run.dir={run_dir}"]
    keys = {o.split("=")[0] for o in worker}
    return cmd + ["-m", "train.distill", *(a for a in argv if a.split("=")[0] not in keys), *worker]


def relaunch(ac, argv: list[str], run_dir: str, device: str) -> None:
    """Replace this process with torchrun when the config asks for more than one process; return otherwise."""
    check_strategy(ac, device)
    if launched() or (ac.num_processes * ac.num_machines == 1 and ac.strategy not in DEEPSPEED):
        return  # DeepSpeed initialises its process group from a launcher's environment, even for one process
    cmd = torchrun_command(ac, argv, run_dir)
    print(f"[draftheads] {ac.num_processes} processes x {ac.num_machines} machine(s), strategy {ac.strategy}: "
          + " ".join(cmd), flush=True)
    os.execv(sys.executable, cmd)


def run_workers(args: list[str]) -> None:
    """torchrun over `args`. A failed worker ends the launcher with that worker's exit code and one line pointing at
    the worker's own error, instead of torchrun's traceback after it (a config error then reads as one)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()  # the root cause; the others were stopped after it
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # killed by a signal: 128 + it
        print(f"[draftheads] rank {rank} of the run exited with code {code} (its error is above)", file=sys.stderr)
        sys.exit(code)


def die_with_launcher() -> None:
    """Linux: SIGKILL this worker when its launcher dies, so a killed run leaves no orphan still writing."""
    if not launched() or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


def resolve_mixed_precision(value: str, device: str) -> str:
    """train.mixed_precision=auto -> bf16 where the hardware trains faster in bfloat16 (a CUDA GPU that supports it; a
    CPU where `cpu_kernels.bf16_trains_faster`: AMX, or AVX-512 BF16 on AMD), else no. Runs before the process group
    and torch.cuda.set_device: it touches no device."""
    if value != "auto":
        return value
    import torch

    if device == "cuda":  # this rank's GPU by index: asking the current device would open a context on GPU 0
        if not torch.cuda.is_available():
            return "no"
        return "bf16" if torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", "0")))[0] >= 8 else "no"
    from inference.cpu_kernels import bf16_trains_faster

    return "bf16" if bf16_trains_faster() else "no"


def make_accelerator(ac, tc, device: str):
    """The run's one Accelerator, built from the Hydra `accelerate` group and train.* (mixed precision, gradient
    accumulation, clipping): the process group exists from here on, so the target is loaded after this call."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    check_strategy(ac, device)
    cpu = device == "cpu"
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed, when imported, would warn while guessing it
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if ac.strategy == "single" and world > 1:
        raise DraftheadsError(f"accelerate.strategy=single but {world} processes were launched; pick accelerate=ddp")
    if device == "cuda" and launched():
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # LOCAL_RANK decides the device, before any load
    # DeepSpeed on CPU: accelerate's cpu=True would silently drop the plugin (plain DDP); cpu=False with gloo keeps it
    backend = "gloo" if cpu and ac.strategy in DEEPSPEED else None
    handlers = [InitProcessGroupKwargs(backend=backend, timeout=timedelta(minutes=ac.timeout_minutes)),
                # some heads leave a depth unused in a micro-batch (COD keeps few deep rows)
                DistributedDataParallelKwargs(find_unused_parameters=True)]
    return Accelerator(cpu=cpu and ac.strategy not in DEEPSPEED, mixed_precision=tc.mixed_precision,
                       gradient_accumulation_steps=tc.grad_accum, step_scheduler_with_optimizer=False,
                       kwargs_handlers=handlers, **strategy_plugins(ac, tc))


def strategy_plugins(ac, tc) -> dict:
    """The Accelerator's plugin arguments for accelerate.strategy: fsdp_plugin, deepspeed_plugin, or none."""
    if ac.strategy == "fsdp":
        return {"fsdp_plugin": _fsdp_plugin(ac)}
    if ac.strategy in DEEPSPEED:
        return {"deepspeed_plugin": _deepspeed_plugin(ac, tc)}
    return {}


def _fsdp_plugin(ac):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["DecoderLayer"], state_dict_type="FULL_STATE_DICT", cpu_offload=ac.offload,
        activation_checkpointing=False)


def _deepspeed_plugin(ac, tc):
    try:
        import deepspeed  # noqa: F401
        from accelerate.utils import DeepSpeedPlugin
    except ImportError:
        raise DraftheadsError(f"accelerate.strategy={ac.strategy} needs DeepSpeed: pip install -e '.[deepspeed]' "
                              "(or pick accelerate=ddp / fsdp)") from None
    check_extension_locks()
    offload = "cpu" if ac.offload else "none"
    plugin = DeepSpeedPlugin(zero_stage=3 if ac.strategy == "zero3" else 2, gradient_accumulation_steps=tc.grad_accum,
                             gradient_clipping=tc.max_grad_norm, offload_optimizer_device=offload,
                             offload_param_device=offload if ac.strategy == "zero3" else "none",
                             zero3_save_16bit_model=True)  # the full state dict is gathered for saving the head
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = tc.batch_size  # prepare() gets no dataloader
    plugin.deepspeed_config["zero_allow_untested_optimizer"] = True  # torch's AdamW
    return plugin


@contextlib.contextmanager
def full_parameters(model):
    """Every parameter of `model` materialised for code outside its forward (RL samples blocks with the head's
    inference path): FSDP2 unshards, ZeRO-3 gathers; other strategies hold whole parameters already."""
    if hasattr(model, "unshard") and hasattr(model, "reshard"):  # FSDP2's fully_shard module
        model.unshard()
        try:
            yield
        finally:
            model.reshard()
        return
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # DeepSpeed ZeRO-3 partitioned parameters
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield
        return
    yield


def as_main_sees_it(accelerator, compute):
    """compute() on the main process, its result (or its DraftheadsError) on every rank: branches taken on what shared
    files hold (the newest checkpoint, kept best weights, a finished head) are decided once, so ranks on machines whose
    network filesystems cache differently cannot take different branches (or stop alone) before a collective."""
    if accelerator.num_processes == 1:
        return compute()
    from accelerate.utils import broadcast_object_list

    outcome = None
    if accelerator.is_main_process:
        try:
            outcome = (True, compute())
        except DraftheadsError as e:
            outcome = (False, str(e))
    ok, value = broadcast_object_list([outcome], from_process=0)[0]
    if not ok:
        raise DraftheadsError(value)
    return value


def calls_everywhere(n: int, model, device) -> int:
    """How often this rank runs a loop whose body calls `model`'s submodules (the loss's chunks, say): n, or under
    DeepSpeed ZeRO-3, where every submodule call gathers that module's parameters in a collective, the most any rank
    needs, so a rank with fewer rows runs empty calls instead of leaving the others waiting in a gather."""
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return n
    import torch
    import torch.distributed as dist

    most = torch.tensor([n], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


STALE_LOCK_MINUTES = 10  # a JIT build of DeepSpeed's ops takes about a minute on 2 cores


def check_extension_locks(root: str | None = None) -> None:
    """DeepSpeed builds its ops with torch's JIT extension loader, which waits forever on a build directory's `lock`
    file; a process killed mid-build (kill -9, the OOM killer) leaves it behind and every later run hangs silently.
    A lock older than STALE_LOCK_MINUTES is an error naming the file (delete it if no build is running)."""
    import time

    base = Path(root or os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    for lock in sorted(base.glob("**/lock")) if base.is_dir() else []:
        minutes = (time.time() - lock.stat().st_mtime) / 60
        if minutes > STALE_LOCK_MINUTES:
            raise DraftheadsError(f"'{lock}' is {minutes:.0f} min old: a DeepSpeed op build was killed and every "
                                  f"run would wait on it forever. If no other build is running, delete it and rerun")


if __name__ == "__main__":  # the launcher train.distill execs (torchrun_command)
    run_workers(sys.argv[1:])
