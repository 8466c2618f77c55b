"""Structured (dataclass) schemas for every config group: a typo or a wrong type fails at compose time; a value
out of its range or set fails in `check_config` (RULES below), before any work and before any process is launched.

Config never reaches model code: entry points read these and call builders with flat, typed parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Optional, get_type_hints

MISSING = "???"  # omegaconf's marker of a required value (this module imports without omegaconf or Hydra: the
# benchmarks' flag checks read it on machines that have neither)


@dataclass
class TargetConfig:
    name: str = "smollm2-135m-instruct"  # built-in name, hub id, or a label when `path` is given
    path: Optional[str] = None  # local model directory or .gguf file
    layer_ids: Optional[list[int]] = None  # hidden states entering these decoder layers; None = (2, L//2, L-3)
    dtype: str = "float32"
    config: Optional[str] = None  # a config.json to plan with (train.dry_run) when the weights are not here


@dataclass
class DraftConfig:
    family: str = "peagle"  # peagle | eagle3 | medusa | dspark | dflash
    k: int = 5  # draft tokens per round (K for P-EAGLE, gamma for DSpark)
    num_layers: int = 1  # decoder layers in the draft head
    parallel: bool = True  # P-EAGLE parallel drafting; false = autoregressive EAGLE-3 chain
    draft_vocab_size: Optional[int] = None  # top-N tokens of the training data; None = full target vocab
    share_embedding: bool = True  # reuse (frozen) target embedding
    share_lm_head: bool = True  # reuse (frozen) target LM head when the draft vocab is the full vocab
    init_from: Optional[str] = None  # an existing draft checkpoint directory (fine-tuning)
    vocab_extend: int = 0  # fine-tuning: add the N most frequent domain tokens missing from the draft vocabulary
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific knobs


@dataclass
class DataConfig:
    source: str = "sharegpt"  # sharegpt | chat_jsonl | prompt_jsonl | text_dir | humaneval
    path: Optional[str] = None  # None = the packaged copy (sharegpt, humaneval)
    max_records: int = 64  # conversations to read (after skipping malformed ones)
    skip_records: int = 0  # records to skip first (e.g. to hold out a split)
    max_length: int = 1024  # tokens per sequence
    overlong: str = "truncate"  # truncate | skip
    regenerate: bool = True  # re-generate assistant turns with the target
    regen_max_new: int = 128  # new tokens per regenerated turn
    regen_turns: int = 1  # assistant turns regenerated per conversation (later turns are dropped)
    regen_batch_size: int = 8
    regen_temperature: float = 0.0
    regen_dtype: str = "bfloat16"  # the runtime decodes in this dtype (bf16: the fast one on CPUs with AVX-512 BF16)
    regen_backend: str = "runtime"  # runtime (this project's) | openai (a vLLM / SGLang server at regen_server)
    regen_server: str = "http://127.0.0.1:8000/v1"
    features: str = "offline"  # offline: hidden states on disk | online: the target runs in the training step | none
    feature_dtype: str = "bfloat16"  # bfloat16 | int8 (per-token absmax scales; online rounds the same way)
    shard_mb: float = 1024  # a feature shard closes at about this size
    cache_dir: Optional[str] = None  # share data between runs: CACHE/<hash of these settings>; a multirun shares by default


@dataclass
class TemperatureConfig:
    start: float = 1.0
    end: float = 1.0
    schedule: str = "constant"  # constant | linear | cosine | exp
    steps: Optional[int] = None  # None = the stage's steps
    scale_loss: bool = False  # the distillation term times T^2 (Hinton et al.): its gradient keeps its size as T moves


@dataclass
class TrainConfig:
    stages: list[str] = field(default_factory=lambda: ["soft_label"])  # soft_label, rl
    steps: int = 200
    rl_steps: int = 50
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 3e-4
    rl_lr: float = 5e-5
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"  # no | bf16 | auto (bf16 where the CPU / GPU computes it natively)
    loss: str = "fkl"  # fkl | rkl | tv | lk (KL+TV mix) ; CE added with ce_weight
    ce_weight: float = 0.1
    position_weighting: str = "exp"  # none | exp  (exp(-(k-1)/gamma))
    position_gamma: Optional[float] = None  # gamma of the exp position weights; None = draft.k
    lk_tv_weight: float = 0.5  # loss=lk: (1 - w) * forward KL + w * TV
    hidden_weight: float = 0.0  # hidden-state regression (P-EAGLE / EAGLE-3): SmoothL1 of the head's LM-head input
    # to the target's at the same position, mean over the hidden size (EAGLE-1's feature loss); 0 = off
    distill_weight: float = 1.0  # weight of the distillation term (DSpark: 0.9 with loss=tv, ce_weight=0.1)
    confidence_weight: float = 1.0  # heads with a confidence head (DSpark): BCE(c_k, 1 - TV_k detached)
    anchors_per_sequence: int = 16  # block heads (dspark / dflash): random anchors per sequence and step
    cod_decay: float = 0.7  # COD sampling: depth d keeps ~ n * decay**d positions
    round_start_weight: float = 0.0  # stage 1: rows drafted from the round starts of the head's greedy chain (walked
    # each step, train/chain.py) weigh 1 + this; 0 = every anchor alike
    temperature: TemperatureConfig = field(default_factory=TemperatureConfig)
    rl_kl_weight: float = 0.1  # KL anchor to the stage-1 head
    rl_draw_score: bool = True  # RL at T > 0: the draws' score term in the gradient; false: pathwise alone (biased)
    rl_pg_weight: float = 0.0  # extra REINFORCE on the exact-rule accepted length (train/rl.py; 0.1 before 2026-12-06)
    rl_max_context: int = 256  # RL: context tokens the target re-reads per sequence (keeps the online forward cheap)
    rl_anchors: int = 16  # RL: draft blocks per sequence and step, all scored in the sequence's one target forward
    rl_anchor_policy: str = "uniform"  # RL: uniform over the answer | round_starts of the head's greedy chain
    rl_temperature: Optional[float] = None  # RL: serving T to optimise; None = train.temperature.end; 0 = greedy
    rl_surrogate_temperature: float = 1.0  # RL at rl_temperature=0: the head's softmax T inside alpha (< 1 sharpens)
    replay_features: Optional[str] = None  # fine-tuning: a feature directory of general data to mix in
    replay_fraction: float = 0.0  # share of the training mixture drawn from replay_features
    checkpoint_every: int = 50
    holdout_sequences: int = 0  # feature sequences held out (from the end) for validation; 0 = none
    data_fraction: float = 1.0  # train on the first fraction of the other sequences (a data curve: same held-out set)
    length_grouped: bool = False  # micro-batches of similar lengths (less right padding), every epoch still a permutation
    eval_every: int = 100  # stage 1: validate every N steps and keep the best head (keep_best_by)
    val_tau_chain: bool = True  # also walk the greedy chain over the held-out answers (~2x a validation's cost)
    keep_best_by: str = "val_tau_chain"  # val_tau_chain (highest; val_loss without it) | val_loss (lowest)
    log_every: int = 10
    seed: int = 0
    resume: bool = True  # resume from the newest checkpoint in the output directory
    wandb: bool = False
    wandb_project: str = "draftheads"
    dry_run: bool = False  # print the memory / data plan (target and head built on the meta device) and stop


@dataclass
class EvalConfig:
    prompts: str = "eval/data/spec_bench_dev.jsonl"
    categories: Optional[str] = "mt_bench"
    limit: Optional[int] = 24
    max_new: int = 64
    k: list[int] = field(default_factory=lambda: [4, 8])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    sources: list[str] = field(default_factory=lambda: ["prompt_lookup"])
    head_tree: bool = True  # also rate a trained parallel / Medusa head as a token tree of k nodes (same verify width)
    domain_prompts: Optional[str] = None  # a second prompt set rated the same way (a prompts JSONL or "humaneval")
    domain_categories: Optional[str] = None
    domain_skip: int = 0  # skip its first N records (those a fine-tune trained on)
    domain_limit: Optional[int] = None
    compare_init: bool = True  # with draft.init_from: also rate the starting head (head_before) and the change


@dataclass
class RuntimeConfig:
    device: str = "cpu"
    threads: int = 2  # 0 = the CPUs this process may use that nothing else keeps busy (inference/threads.py)


@dataclass
class AccelerateConfig:
    """How many processes train and how the head is spread over them (train/distributed.py reads this, nothing else:
    the Hydra group is the one source of truth; no separate accelerate yaml)."""
    strategy: str = "single"  # single | ddp | fsdp | zero2 | zero3 (DeepSpeed ZeRO through accelerate)
    num_processes: int = 1  # processes per machine (one per GPU); > 1 and not yet launched: train.distill runs torchrun
    num_machines: int = 1
    machine_rank: int = 0  # this machine's index (multi-node: run the same command on every machine)
    main_process_ip: str = "127.0.0.1"
    main_process_port: int = 29500
    offload: bool = False  # zero2 / zero3 / fsdp: optimizer states (zero3, fsdp: parameters too) live in CPU RAM
    timeout_minutes: int = 720  # how long a rank waits at a barrier (e.g. for rank 0's data stage) before failing


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    accelerate: AccelerateConfig = field(default_factory=AccelerateConfig)
    output_dir: str = "outputs/${hydra:job.config_name}"
    name: str = MISSING


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in [("target", TargetConfig), ("draft", DraftConfig), ("data", DataConfig), ("train", TrainConfig),
                        ("eval", EvalConfig), ("runtime", RuntimeConfig), ("accelerate", AccelerateConfig)]:
        cs.store(group=group, name=f"base_{group}", node=node)


# ---------------------------------------------------------------------------------------------
# legal values: every number has a range, every string that selects something a set (tests/test_config.py checks
# that no field is left out); None passes where the field is Optional
# ---------------------------------------------------------------------------------------------
def at_least(lo: float) -> Callable:
    return lambda v: (math.isfinite(v) and v >= lo, f"must be >= {lo:g}")


def above(lo: float) -> Callable:
    return lambda v: (math.isfinite(v) and v > lo, f"must be > {lo:g}")


def between(lo: float, hi: float) -> Callable:
    return lambda v: (math.isfinite(v) and lo <= v <= hi, f"must be in [{lo:g}, {hi:g}]")


def one_of(*names: str) -> Callable:
    return lambda v: (v in names, f"must be one of {list(names)}")


def each(rule: Callable) -> Callable:
    def check(values):
        for v in values:
            ok, why = rule(v)
            if not ok:
                return False, f"every entry {why}"
        return True, ""
    return check


def _families() -> dict:
    from models.families import FAMILIES  # the registry (imported when checking: conf stays importable alone)

    return FAMILIES


DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
RULES: dict[str, Callable] = {
    "target.dtype": one_of(*DTYPES), "target.layer_ids": each(at_least(0)),
    "draft.family": lambda v: (v in _families(), f"must be one of {sorted(_families())} (models/families.py)"),
    "draft.k": between(1, 64),
    "draft.num_layers": between(1, 64), "draft.draft_vocab_size": at_least(1), "draft.vocab_extend": at_least(0),
    "data.source": one_of("sharegpt", "chat_jsonl", "prompt_jsonl", "text_dir", "humaneval"),
    "data.max_records": at_least(1), "data.skip_records": at_least(0), "data.max_length": at_least(8),
    "data.overlong": one_of("truncate", "skip"), "data.regen_max_new": at_least(1), "data.regen_turns": at_least(1),
    "data.regen_batch_size": at_least(1), "data.regen_temperature": at_least(0), "data.regen_dtype": one_of(*DTYPES),
    "data.regen_backend": one_of("runtime", "openai"), "data.features": one_of("offline", "online", "none"),
    "data.feature_dtype": one_of("bfloat16", "int8"), "data.shard_mb": above(0),
    "train.stages": each(one_of("soft_label", "rl")), "train.steps": at_least(1), "train.rl_steps": at_least(0),
    "train.batch_size": at_least(1), "train.grad_accum": at_least(1), "train.lr": above(0), "train.rl_lr": above(0),
    "train.weight_decay": at_least(0), "train.warmup_steps": at_least(0), "train.max_grad_norm": at_least(0),
    "train.mixed_precision": one_of("no", "bf16", "auto"), "train.loss": one_of("fkl", "rkl", "tv", "lk"),
    "train.ce_weight": at_least(0), "train.position_weighting": one_of("none", "exp"),
    "train.round_start_weight": at_least(0), "train.position_gamma": above(0), "train.lk_tv_weight": between(0, 1),
    "train.hidden_weight": at_least(0),
    "train.distill_weight": at_least(0), "train.confidence_weight": at_least(0),
    "train.anchors_per_sequence": at_least(1), "train.cod_decay": between(0.01, 1),
    "train.temperature.start": above(0), "train.temperature.end": above(0),
    "train.temperature.schedule": one_of("constant", "linear", "cosine", "exp"), "train.temperature.steps": at_least(1),
    "train.rl_kl_weight": at_least(0), "train.rl_pg_weight": at_least(0), "train.rl_max_context": at_least(2),
    "train.rl_anchors": at_least(1), "train.rl_anchor_policy": one_of("uniform", "round_starts"),
    "train.rl_temperature": at_least(0), "train.rl_surrogate_temperature": above(0),
    "train.checkpoint_every": at_least(1), "train.holdout_sequences": at_least(0), "train.eval_every": at_least(1),
    "train.keep_best_by": one_of("val_tau_chain", "val_loss"), "train.log_every": at_least(1),
    "train.seed": at_least(0), "train.replay_fraction": between(0, 0.95),
    "train.data_fraction": lambda v: (math.isfinite(v) and 0 < v <= 1, "must be in (0, 1]"),
    "eval.limit": at_least(0), "eval.max_new": at_least(1), "eval.domain_skip": at_least(0),
    "eval.domain_limit": at_least(1), "eval.k": each(between(1, 64)),
    "eval.temperatures": each(at_least(0)),
    "runtime.device": one_of("cpu", "cuda"), "runtime.threads": between(0, 1024),
    "accelerate.strategy": one_of("single", "ddp", "fsdp", "zero2", "zero3"), "accelerate.num_processes": at_least(1),
    "accelerate.num_machines": at_least(1), "accelerate.machine_rank": at_least(0),
    "accelerate.main_process_port": between(1, 65535), "accelerate.timeout_minutes": at_least(1),
}
FREE_FORM = {"target.name", "target.path", "target.config", "draft.init_from", "draft.extra", "data.path",
             "data.regen_server", "data.cache_dir",
             "train.wandb_project", "train.replay_features", "eval.prompts", "eval.categories", "eval.sources",
             "eval.domain_prompts", "eval.domain_categories",
             "accelerate.main_process_ip", "output_dir", "name"}


def schema_fields(node=Config, prefix: str = ""):
    """(dotted name, type) of every leaf field of the schema."""
    hints = get_type_hints(node)
    for f in fields(node):
        kind = hints[f.name]
        if is_dataclass(kind):
            yield from schema_fields(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", kind


def check_config(cfg) -> None:
    """Raise DraftheadsError naming the first value out of its range or set, and what is legal."""
    from models.errors import DraftheadsError

    for name, rule in RULES.items():
        node = cfg
        for part in name.split("."):
            node = node[part]
        if node is None:
            continue
        ok, why = rule(node)
        if not ok:
            raise DraftheadsError(f"{name}={node} {why}; fix it on the command line or in the experiment file")
    from models.families import family_options

    family_options(cfg.draft.family, cfg.draft.extra)
    d, e = cfg.data, cfg.eval
    same_set = e.domain_prompts is not None and (e.domain_prompts == d.source or (d.path is not None and (
        Path(e.domain_prompts).resolve() == Path(d.path).resolve())))
    if same_set and e.domain_skip < d.skip_records + d.max_records:
        raise DraftheadsError(f"eval.domain_skip={e.domain_skip} rates the head on records of '{e.domain_prompts}' it "
                              f"trained on (data.skip_records + data.max_records = {d.skip_records + d.max_records}); "
                              f"set eval.domain_skip={d.skip_records + d.max_records} or more")


def check_args(args, rules: dict[str, Callable]) -> None:
    """The same ranges for a command line's arguments (argparse namespace): `--max-new=0 must be >= 1`."""
    from models.errors import DraftheadsError

    for name, rule in rules.items():
        value = getattr(args, name, None)  # a command without this argument: nothing to check
        if value is None:
            continue
        ok, why = rule(value)
        if not ok:
            raise DraftheadsError(f"--{name.replace('_', '-')}={value} {why}")
