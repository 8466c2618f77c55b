"""Faults injected where progress is written: a file cut at many byte offsets, a full disk, kill -9 at random moments.
Each resumes to exactly what an uninterrupted run writes, and a full disk is one clear line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from data.regenerate import regenerate
from eval.probe_table import mount_tmpfs
from models.errors import DraftheadsError
from train.loop import RunLog

ROOT = Path(__file__).resolve().parents[1]
CONVS = [[{"role": "user", "content": f"tell me about {i} " * (1 + i % 3)}, {"role": "assistant", "content": "x"}]
         for i in range(12)]


def test_regeneration_cut_at_any_byte_resumes_to_the_same_records(tiny_target, tmp_path):
    kw = dict(max_new=10, batch_size=4, temperature=1.0, seed=5)
    regenerate(tiny_target, CONVS, tmp_path / "ref.jsonl", **kw)
    ref = (tmp_path / "ref.jsonl").read_bytes()
    ends = [i + 1 for i, b in enumerate(ref) if b == ord("\n")]
    offsets = sorted({0, len(ref) - 1, *ends, *(e - 1 for e in ends), *range(0, len(ref), len(ref) // 23)})
    for cut in offsets:
        path = tmp_path / f"cut_{cut}.jsonl"
        path.write_bytes(ref[:cut])
        regenerate(tiny_target, CONVS, path, **kw)
        assert path.read_bytes() == ref, cut  # no record lost, none twice, same order
    assert len(offsets) >= 30


def test_metrics_cut_at_any_byte_keep_every_complete_line_once(tmp_path):
    rows = [{"stage": "soft_label", "step": s, "loss": 1.0 / s} for s in range(1, 9)]
    full = "".join(json.dumps(r) + "\n" for r in rows).encode()
    for cut in range(len(full)):
        path = tmp_path / "metrics.jsonl"
        path.write_bytes(full[:cut])
        RunLog(path, main=True).resume("soft_label", 4)  # resumed from the step-4 checkpoint
        kept = [json.loads(x) for x in path.read_text().splitlines()]
        complete = full[:cut].count(b"\n")
        assert [r["step"] for r in kept] == list(range(1, min(complete, 4) + 1)), cut


def test_runs_sharing_a_data_cache_prepare_it_one_at_a_time(tmp_path, capsys):
    """Two W&B agents on one machine share data.cache_dir: the second waits on CACHE/.lock while the first prepares
    (it said so), instead of both appending to the same regeneration file."""
    import subprocess
    import time

    from data.prepare import Workers
    from train.distill import cache_lock

    hold = "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True); " \
           "time.sleep(1.5)"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / ".lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "1"
    t0 = time.monotonic()
    with cache_lock(tmp_path, Workers()):
        waited = time.monotonic() - t0
    holder.wait()
    assert waited > 1.0 and "another run is preparing data in" in capsys.readouterr().out
    with cache_lock(None, Workers()):  # no shared cache: no lock
        pass


def test_wandb_steps_count_on_from_stage_one_into_rl(tmp_path):
    """W&B drops a step below its current one: RL's step 0 (its first validation) must follow stage 1's last step."""
    logged = []

    class Run:
        def log(self, values, step):
            logged.append((next(iter(values)).split("/")[0], step))

    log = RunLog(tmp_path / "metrics.jsonl", main=True, wandb_run=Run())
    for stage, steps in (("soft_label", range(50, 201, 50)), ("rl", range(0, 31, 10))):
        for step in steps:
            log.write({"stage": stage, "step": step, "loss": 1.0})
    assert logged == [("soft_label", 50), ("soft_label", 100), ("soft_label", 150), ("soft_label", 200),
                      ("rl", 201), ("rl", 211), ("rl", 221), ("rl", 231)]


ARGS = [sys.executable, "-m", "train.distill", "+experiment=smoke", "data.max_records=8", "train.steps=4", "eval.limit=0",
        "runtime.threads=1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    assert subprocess.run([*ARGS, f"output_dir={out}"], cwd=ROOT, capture_output=True, timeout=300).returncode == 0
    return out


@pytest.mark.parametrize("size,message", [
    ("400k", "needs 0.5 MiB for the remaining features but its disk has 0.4 MiB free"),  # checked before extracting
    ("560k", "the disk is full while writing"),  # the features fit, a later write fills the disk
    ("900k", "the disk is full while writing"),  # torch.save of a checkpoint runs out
])
def test_a_full_disk_is_one_clear_line_and_the_rerun_resumes(reference, tmp_path, size, message):
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, size):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        r = subprocess.run([*ARGS, f"output_dir={disk}/run"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert message in last and str(disk) in last and "rerun the same command" in last, last
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        again = subprocess.run([*ARGS, f"output_dir={disk}/run"], cwd=ROOT, capture_output=True, text=True,
                               timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        for name in ("data/regenerated.jsonl", "data/features/shard_00000.safetensors", "head/model.safetensors"):
            assert (disk / "run" / name).read_bytes() == (reference / name).read_bytes(), name
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_kill_9_at_random_moments_resumes_to_the_uninterrupted_outputs(tmp_path):
    """A short run of eval/kill_harness.py (the full one: 50 kills, marked slow below)."""
    from eval.kill_harness import run_harness

    result = run_harness(kills=2, out=tmp_path, seed=1)
    assert result["all_equal"] and result["kills"] >= 2 and result["max_weight_diff"] <= 1e-6, result


@pytest.mark.slow
def test_kill_9_at_fifty_random_moments(tmp_path):
    from eval.kill_harness import run_harness

    result = run_harness(kills=50, out=tmp_path, seed=0)
    print(json.dumps({k: v for k, v in result.items() if k != "details"}))
    assert result["all_equal"] and result["kills"] >= 50, result


def test_a_damaged_best_marker_counts_as_no_best(tmp_path):
    from train.loop import _read_best

    (tmp_path / "best").mkdir()
    for damaged in ("", "{", "[]", '{"step": 4}'):
        (tmp_path / "best" / "best.json").write_text(damaged)
        assert _read_best(tmp_path) is None
    (tmp_path / "best" / "best.json").write_text('{"step": 4, "val_loss": 1.5}')
    assert _read_best(tmp_path) is None  # the weights it marks are missing
    (tmp_path / "best" / "model.safetensors").write_bytes(b"")
    assert _read_best(tmp_path) == {"step": 4, "val_loss": 1.5}  # a record from before records named their file
    # a kill after the step-6 weights and before their record: the step-4 record still names its own weights
    named = {"step": 4, "val_loss": 1.5, "file": "model_step4.safetensors"}
    (tmp_path / "best" / "best.json").write_text(json.dumps(named))
    (tmp_path / "best" / "model_step6.safetensors").write_bytes(b"")
    assert _read_best(tmp_path) is None
    (tmp_path / "best" / "model_step4.safetensors").write_bytes(b"")
    assert _read_best(tmp_path) == named


@pytest.mark.parametrize("call", ["check_writable", "write_atomic"])
def test_processes_checking_or_writing_one_path_at_once_do_not_trip_each_other(tmp_path, call):
    """Every rank checks --out before the τ table: the write probes of concurrent checks must not collide (one
    process deleting the other's probe made a rank exit with 'cannot be written'). Two writers of one progress file
    never share a temporary name (the second rename found nothing to rename)."""
    import threading

    from models.files import check_writable, write_atomic

    out, errors = tmp_path / "eval" / "row.json", []
    out.parent.mkdir()
    act = {"check_writable": lambda i: check_writable(out, "--out"), "write_atomic": lambda i: write_atomic(out, f"{i}")}

    def hammer():
        try:
            for i in range(300):
                act[call](i)
        except Exception as e:  # collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    left = [p.name for p in out.parent.iterdir()]  # no probe or temporary file behind
    assert left == [] if call == "check_writable" else left == ["row.json"] and out.read_text() == "299"


def test_ranks_starting_together_convert_the_target_once_and_all_read_the_whole_directory(tmp_path):
    """Two ranks on a fresh machine both found no converted target: each removed the other's temporary directory,
    and one loaded a directory without its config ('Unrecognized model'). Now one builds, the other waits for it."""
    script = f"""
import sys, time
from pathlib import Path
from models.files import build_directory_once
def build(tmp):
    with open({str(tmp_path / "builds.log")!r}, "a") as log:
        log.write("built\\n")
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"w" * 1000)
    time.sleep(1.0)  # the other rank arrives while this one writes
    (tmp / "config.json").write_text("{{}}")
out = build_directory_once({str(tmp_path / "target")!r}, build)
print(sorted(p.name for p in Path(out).iterdir()))
"""
    ranks = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1]) for _ in range(2)]
    outs = [r.communicate(timeout=60)[0].strip() for r in ranks]
    assert [r.returncode for r in ranks] == [0, 0]
    assert outs == ["['config.json', 'model.safetensors']"] * 2
    assert (tmp_path / "builds.log").read_text() == "built\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builds.log", "target", "target.lock"]


def test_a_converter_of_any_rank_writes_the_weights_and_the_target_loads_from_them_unchanged(tmp_path):
    """transformers 5.x's save_pretrained writes weights on rank 0 of a process group only: on a fresh machine the
    rank that won the conversion lock was rank 1, the cached target held a tokenizer and no config or weights, and
    every later run failed with 'Unrecognized model'. Both ranks of a gloo group now write whole directories."""
    script = f"""
import json, sys, torch
from pathlib import Path
from models.target import _load_dir, save_model_directory, tiny_random_llama
rank = int(sys.argv[1])
torch.distributed.init_process_group("gloo", init_method="file://{tmp_path}/group", rank=rank, world_size=2)
model, tok = tiny_random_llama(seed=3)
out = Path({str(tmp_path)!r}) / f"rank{{rank}}"
save_model_directory(model, tok, out)
loaded, _ = _load_dir(out, torch.float32)
ids = torch.tensor([[1, 5, 9, 2, 7]])
with torch.no_grad():
    same = torch.equal(model(ids).logits, loaded(ids).logits)
print(sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".safetensors")), same,
      json.loads((out / "config.json").read_text())["architectures"])
"""
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for r in range(2)]
    outs = [r.communicate(timeout=120)[0].strip().splitlines()[-1] for r in ranks]
    assert [r.returncode for r in ranks] == [0, 0]
    files = "['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']"
    assert outs == [f"{files} True ['LlamaForCausalLM']"] * 2


def test_a_cached_directory_without_its_files_is_built_again_and_a_build_that_writes_none_is_named(tmp_path):
    from models.files import build_directory_once

    out = tmp_path / "target"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # what the rank-1 conversion left
    def build(tmp):
        tmp.mkdir()
        for name in ("config.json", "model.safetensors"):
            (tmp / name).write_text("x")
    build_directory_once(out, build, required=("config.json", "model.safetensors"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(DraftheadsError, match=r"converting X wrote no model.safetensors \(its partial output is in "
                                              r"'.*/other.tmp'\); check the free space under '.*' and rerun"):
        build_directory_once(tmp_path / "other", lambda tmp: (tmp.mkdir(), (tmp / "config.json").write_text("x")),
                             required=("config.json", "model.safetensors"), what="converting X")
    assert not (tmp_path / "other").exists()


def test_a_deepspeed_build_lock_left_by_a_killed_run_is_named_instead_of_hanging(tmp_path):
    """torch's JIT extension loader waits forever on a lock a killed build left (seen: every zero2/zero3 run hung
    after an OOM kill); an old lock is an error naming the file, a fresh one (a build in progress) is not."""
    import os
    import time

    from train.distributed import check_extension_locks

    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    check_extension_locks(str(tmp_path))  # a build in progress
    old = time.time() - 20 * 60
    os.utime(lock, (old, old))
    with pytest.raises(DraftheadsError, match=r"deepspeed_shm_comm/lock' is 20 min old.*delete it and rerun"):
        check_extension_locks(str(tmp_path))


def test_a_killed_writers_temporary_is_removed_by_the_next_write_and_a_live_ones_is_not(tmp_path):
    import os
    import subprocess
    import sys

    from models.files import write_atomic

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"x.json.{int(gone.stdout)}.1.tmp"  # what kill -9 during a write leaves
    live = tmp_path / f"x.json.{os.getpid()}.99.tmp"  # another thread of a running writer
    other = tmp_path / f"y.json.{int(gone.stdout)}.1.tmp"
    for f in (dead, live, other):
        f.write_bytes(b"partial")
    synced = []
    real_fsync = os.fsync
    os.fsync = lambda fd: synced.append(fd) or real_fsync(fd)
    try:
        write_atomic(tmp_path / "x.json", "{}")
    finally:
        os.fsync = real_fsync
    assert len(synced) == 2  # the file before its rename, the directory after it
    assert not dead.exists() and live.exists() and other.exists() and (tmp_path / "x.json").read_text() == "{}"


def test_decisions_read_from_shared_files_are_the_main_processes_on_every_rank(monkeypatch):
    """The newest checkpoint, kept best weights and a finished head are read by the main process alone and broadcast
    (a rank whose network filesystem lagged took another branch before a collective); an error there (e.g. train.steps
    past a head without its checkpoint) stops every rank with the main process's message, not the main one alone."""
    from types import SimpleNamespace

    import accelerate.utils

    from train.distributed import as_main_sees_it

    sent = []

    def broadcast(objects, from_process=0):  # two ranks: what the main process put in is what every rank gets
        if objects[0] is not None:
            sent.append(objects[0])
        return [sent[-1]]

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)
    main, other = (SimpleNamespace(num_processes=2, is_main_process=m) for m in (True, False))
    assert as_main_sees_it(main, lambda: (3, Path("step_3"))) == (3, Path("step_3"))
    assert as_main_sees_it(other, lambda: pytest.fail("read on a rank that is not the main one")) == (3, Path("step_3"))

    def stale():
        raise DraftheadsError("its step-300 checkpoint is not in 'ckpt'")

    for rank in (main, other):
        with pytest.raises(DraftheadsError, match="step-300 checkpoint is not in 'ckpt'"):
            as_main_sees_it(rank, stale if rank is main else lambda: pytest.fail("read off the main process"))
