"""Two CPU processes (gloo) against one: disjoint batches that add up to the single-process global batch, the same
loss curve, the data stage run once, one copy of every output, and kill -9 of the launcher resumed exactly."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _worker(out: Path, grad_accum: int, strategy: str, online: bool = False):
    cmd = [*(TORCHRUN if strategy != "single" else [sys.executable]), "tests/multiprocess_worker.py", str(out),
           str(grad_accum), strategy, *(["online"] if online else [])]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The references, offline and online: global batch = 2 micro-batches x 2 sequences in one process."""
    runs = {}

    def get(online: bool) -> Path:
        if online not in runs:
            runs[online] = _worker(tmp_path_factory.mktemp("one"), grad_accum=2, strategy="single", online=online)
        return runs[online]

    return get


@pytest.mark.parametrize("strategy,online", [("ddp", False), ("zero2", False), ("zero3", False), ("zero3", True)])
def test_two_ranks_read_the_single_process_global_batch_and_follow_its_curve(one_process, tmp_path, strategy, online):
    """The same global batch over 2 ranks (data parallel, DeepSpeed ZeRO-2 and ZeRO-3 on gloo): same curve, same head
    (ZeRO-3's is gathered from shards onto the main process). Online, the target's decoder layers are FSDP2-sharded
    over the 2 ranks and compute the hidden states in the step; the reference runs a whole target in one process."""
    if strategy != "ddp":
        pytest.importorskip("deepspeed")
    one, two = one_process(online), _worker(tmp_path / "two", grad_accum=1, strategy=strategy, online=online)
    ref = json.loads((one / "batches_rank0.json").read_text())
    ranks = [json.loads((two / f"batches_rank{r}.json").read_text()) for r in (0, 1)]
    micros = [{b["micro"] for b in rank} for rank in ranks]
    assert micros[0].isdisjoint(micros[1]) and len(micros[0]) == len(micros[1]) == 8
    assert micros[0] | micros[1] == {b["micro"] for b in ref} == set(range(16))
    by_micro = {b["micro"]: b["ids"] for rank in ranks for b in rank}
    for b in ref:  # optimizer step s reads micro-batches 2s and 2s+1 in both runs: same sequences
        assert by_micro[b["micro"]] == b["ids"]
    a, b = _rows(one / "metrics.jsonl"), _rows(two / "metrics.jsonl")
    assert [(r["stage"], r["step"], "val_loss" in r) for r in a] == [(r["stage"], r["step"], "val_loss" in r) for r in b]
    for ra, rb in zip(a, b):  # float tolerance: gradients averaged by all-reduce vs summed by accumulation
        for key in ("loss", "val_loss", "val_tau_est", "val_tau_chain", "acc_1"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), (ra, rb)
    wa, wb = load_file(one / "head" / "model.safetensors"), load_file(two / "head" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head", ["parallel", "chain", "medusa"])
def test_zero3_ranks_with_unequal_rows_make_the_same_collective_calls(tmp_path, head):
    """ZeRO-3 gathers a module's parameters at each call: a head with its own LM head (a draft vocabulary) ran as many
    loss chunks as the rank's rows needed, so ranks with other sequence lengths waited in different gathers (gloo: a
    size mismatch; NCCL: a hang until the timeout). A chain head's depths, and a sequence shorter than K + 2 tokens
    (an IndexError), likewise, and Medusa's per-depth heads. Every rank now runs the most chunks any needs, and every
    depth; full and short chunks make the same recompute choice."""
    pytest.importorskip("deepspeed")
    r = subprocess.run([*TORCHRUN, "tests/multiprocess_worker.py", "chunks", str(tmp_path), head], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rows_rank{k}.json").read_text()) for k in (0, 1)]
    assert len(rows[0]) == len(rows[1]) >= 2 and rows[0] != rows[1]  # training and validation: unequal rows
    assert (tmp_path / "head" / "model.safetensors").is_file()


def _distill(out: Path, *extra, env=None):
    args = [sys.executable, "-m", "train.distill", "+experiment=smoke", f"output_dir={out}", "accelerate=ddp",
            "accelerate.num_processes=2", "runtime.threads=2", "data.max_records=12", "train.steps=10",
            "train.checkpoint_every=3", "train.log_every=1", "eval.limit=0", *extra]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _finish(proc) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def _processes_writing(out: Path) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and f"output_dir={out}".encode() in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except OSError:
            pass
    return found


def test_launch_kill_9_and_relaunch_continue_the_curve_with_one_copy_of_every_output(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    _finish(_distill(full))
    records = [json.loads(x) for x in (full / "data" / "regenerated.jsonl").read_text().splitlines()]
    assert len(records) == len({r["id"] for r in records}) == json.loads(
        (full / "data" / "data_report.json").read_text())["regenerate"]["records"]  # the data stage ran once
    shutil.copytree(full / "data", killed / "data")  # the same data: nothing is regenerated

    proc = _distill(killed, env={"DRAFTHEADS_TEST_STEP_SLEEP": "0.4"})
    deadline = time.time() + 120
    while time.time() < deadline:
        m = killed / "metrics.jsonl"
        if m.exists() and any(r.get("step", 0) >= 5 for r in _rows(m) if r.get("stage") == "soft_label"):
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the slowed run never reached step 5")
    os.kill(proc.pid, signal.SIGKILL)  # the launcher (torchrun, exec'd by train.distill)
    proc.communicate()
    time.sleep(1.0)
    assert _processes_writing(killed) == []  # its workers died with it
    assert not (killed / "head").exists()
    _finish(_distill(killed))

    a, b = _rows(full / "metrics.jsonl"), _rows(killed / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 11))  # every step once
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6, abs=1e-7)
    wa, wb = load_file(full / "head" / "model.safetensors"), load_file(killed / "head" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-6, atol=1e-7)
    for run, launches in ((full, 1), (killed, 2)):  # one Hydra directory per launch, not one per rank
        assert len(list((run / "hydra").iterdir())) == launches
        assert not list(run.rglob("*.tmp"))
        assert (run / "run_report.json").is_file() and (run / "resolved_config.yaml").is_file()


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_sharded_target_reads_its_rows_from_the_files_and_computes_what_the_whole_one_does(tmp_path, strategy):
    """Under zero3 too: transformers would otherwise build the target inside ZeRO-3's zero.Init (accelerate registers
    its DeepSpeed config), which failed every load from a directory."""
    from models.target import tiny_random_llama

    if strategy == "zero3":
        pytest.importorskip("deepspeed")

    model, tok = tiny_random_llama(num_layers=4)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    r = subprocess.run([*TORCHRUN, "tests/multiprocess_worker.py", "target", str(tmp_path / "model"), str(tmp_path),
                        strategy],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"target_rank{i}.json").read_text()) for i in (0, 1)]
    for got in ranks:
        assert got["aux"] == 0.0 and got["logits"] == 0.0  # measured: bitwise equal
        assert got["light_meta_layers"] and got["light_lm_head_equal"]
    assert sum(g["layer_params_here"] for g in ranks) == ranks[0]["layer_params"]  # each rank holds half
    assert ranks[0]["layer_params_here"] == ranks[1]["layer_params_here"]


def test_two_processes_split_the_data_stage_and_the_tau_table_and_merge_what_one_process_writes(tmp_path):
    """Regeneration (batches round-robin over ranks), feature extraction (a contiguous block per rank) and the τ table
    (prompts round-robin) in 2 processes give the records, features and τ rows of 1 process: same ids, same text at
    T=0, same tokens, the same turns in the same order at T=0 and T=1 (seeds follow the prompt)."""
    from data.features import FeatureDataset

    runs = {}
    for n in (1, 2):
        out = tmp_path / f"p{n}"
        extra = ["accelerate=ddp", "accelerate.num_processes=2"] if n == 2 else []
        r = subprocess.run([sys.executable, "-m", "train.distill", "+experiment=smoke", f"output_dir={out}",
                            "data.max_records=20", "data.regen_batch_size=4", "train.stages=[]", "eval.limit=3",
                            "eval.temperatures=[0.0,1.0]", "eval.sources=[prompt_lookup]",
                            "runtime.threads=2", *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[n] = out
    one, two = (runs[n] / "data" / "regenerated.jsonl" for n in (1, 2))
    assert one.read_bytes() == two.read_bytes() and len(one.read_text().splitlines()) >= 12
    assert sorted(p.name for p in (runs[2] / "data").glob("regenerated.part_*.jsonl")) == [
        "regenerated.part_0-of-2.jsonl", "regenerated.part_1-of-2.jsonl"]
    report = json.loads((runs[2] / "data" / "data_report.json").read_text())
    totals = report["regenerate"]["all_runs"]
    assert totals["runs"] == 1 and totals["new_tokens"] > 0  # both parts' tokens, from their progress files
    for stage in (report["regenerate"], report["features"]):  # both processes' work, not the main one's alone
        each = stage["per_process"]
        assert len(each) == 2 and all(e["new_tokens"] > 0 for e in each)
        assert stage["new_tokens"] == sum(e["new_tokens"] for e in each)
        assert stage["seconds"] == max(e["seconds"] for e in each)
    assert report["regenerate"]["new_tokens"] == totals["new_tokens"]
    assert report["features"]["new_tokens"] == report["features"]["tokens"]
    a, b = FeatureDataset(runs[1] / "data" / "features"), FeatureDataset(runs[2] / "data" / "features")
    assert b.manifest["parts"] == 2 and len(a) == len(b) > 8
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        torch.testing.assert_close(y["aux_hidden"], x["aux_hidden"], atol=0.02, rtol=0.01)  # bf16, other packing
    rows = {n: sorted((runs[n] / "eval").glob("*/prompt_lookup_k*.json")) for n in (1, 2)}
    assert [p.name for p in rows[1]] == [p.name for p in rows[2]] == ["prompt_lookup_k4_T0.json",
                                                                      "prompt_lookup_k4_T1.json"]
    for a, b in zip(rows[1], rows[2]):
        x, y = json.loads(a.read_text()), json.loads(b.read_text())
        assert x["turns"] == y["turns"] and len(x["turns"]) == 6  # 3 two-turn MT-bench prompts
        assert x["overall"]["tau"] == y["overall"]["tau"] and x["overall"]["requests"] == 6


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    from conf.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_the_accelerate_group_is_the_one_source_of_strategy_and_launch():
    from train.distributed import strategy_plugins, torchrun_command

    assert strategy_plugins(_compose("accelerate=ddp").accelerate, _compose().train) == {}
    fsdp = _compose("accelerate=fsdp")
    plugin = strategy_plugins(fsdp.accelerate, fsdp.train)["fsdp_plugin"]
    assert plugin.fsdp_version == 2 and plugin.transformer_cls_names_to_wrap == ["DecoderLayer"]
    if pytest.importorskip("deepspeed"):
        cfg = _compose("+experiment=peagle_70b")
        ds = strategy_plugins(cfg.accelerate, cfg.train)["deepspeed_plugin"]
        assert ds.zero_stage == 3 and ds.deepspeed_config["train_micro_batch_size_per_gpu"] == cfg.train.batch_size
        assert ds.deepspeed_config["gradient_accumulation_steps"] == cfg.train.grad_accum == 32  # one setting
    cmd = torchrun_command(_compose("accelerate=ddp").accelerate, ["+experiment=smoke", "hydra.run.dir=x"], "RUN")
    assert cmd[3:5] == ["--nproc_per_node=2", "--standalone"] and cmd[-1] == "hydra.run.dir=RUN"
    assert cmd.count("hydra.run.dir=x") == 0 and "+experiment=smoke" in cmd
    multi = _compose("accelerate=zero3", "accelerate.num_machines=2", "accelerate.machine_rank=1",
                     "accelerate.main_process_ip=10.0.0.1").accelerate
    cmd = torchrun_command(multi, [], "RUN")
    assert {"--nproc_per_node=8", "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1"} <= set(cmd)


def test_a_worker_error_ends_the_launch_with_its_code_and_one_line_after_it(tmp_path):
    """Offline features cannot be extracted by a sharded target (ranks would wait on each other's gathers until the
    timeout): refused before any work, in each rank; the launcher exits with the worker's code 2 and no traceback."""
    pytest.importorskip("deepspeed")
    r = subprocess.run([sys.executable, "-m", "train.distill", "+experiment=smoke", f"output_dir={tmp_path}",
                        "accelerate=zero3", "accelerate.num_processes=2", "data.regen_backend=openai"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "error: data.features=offline cannot be extracted with a sharded target (accelerate=zero3" in r.stderr
    assert re.fullmatch(r"\[draftheads\] rank [01] of the run exited with code 2 \(its error is above\)",
                        r.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("overrides,message", [
    (("accelerate.strategy=zero4",), "accelerate.strategy=zero4 must be one of"),
    (("accelerate.num_processes=2",), "accelerate.strategy=single runs one process, not 2"),
    (("accelerate=fsdp", "runtime.device=cpu"), "accelerate.strategy=fsdp shards over GPUs"),
    (("accelerate=ddp", "accelerate.machine_rank=3"), "accelerate.machine_rank=3 must be in 0..0"),
])
def test_bad_process_settings_are_one_clear_line(overrides, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "train.distill", "+experiment=smoke", f"output_dir={tmp_path}", *overrides],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert message in r.stderr.strip().splitlines()[-1]
