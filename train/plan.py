"""A plan before the spend: `python -m train.distill +experiment=NAME train.dry_run=true`.

Builds the target and the head on the meta device (no weights, no memory) from the target's config.json and prints
parameter counts, memory per GPU for every strategy and GPU count, feature bytes per token and in total (offline vs
online), tokens per optimizer step, and a verdict per row. The formulae, per GPU, N GPUs, P trainable head
parameters, w = 2 bytes under bf16 mixed precision (else 4), t = the target's bytes per parameter:

  model states   ddp / single: 16 P  (fp32 weights 4, fp32 gradients 4, AdamW moments 8)
                 zero2:  w P + (16 - w) P / N     (compute weights replicated; gradients, fp32 master, moments sharded)
                 zero3 / fsdp: 16 P / N + 2 w L   (L = the largest head layer, gathered with one prefetched)
                 DeepSpeed's bf16 ZeRO-2/3 also casts each optimizer sub-group's gradient partition to fp32 for the
                 step (4 P / N with its default 1e9-parameter sub-groups): after backward, when the activations
                 below are freed, so the backward's peak is the one counted while they exceed it
  frozen target  offline: t F, F = embedding + final norm + LM head (the head reads them), replicated
                 online:  t P_target (single, ddp, zero2: replicated) or t F + t (P_target - F) / N + 2 t L_target
                          (fsdp, zero3: decoder layers FSDP2-sharded, L_target = one layer, gathered with one prefetched)
  activations    rows R = b T c per micro-batch (b sequences of T tokens, c = sum_{d<K} decay^d COD rows per token;
                 block heads: b A K for A anchors). The float32 feature batch b T (n + 1) H 4; per row and head layer
                 a (6H + 5q + 2kv + 5I) + 12H bytes saved for backward (q = heads x head_dim, kv = kv_heads x head_dim,
                 I = MLP width, a = activation bytes, norms in fp32), the first layer's input 2H wide, the fc output
                 R H a and the attention mask b (T c)^2 bool (Medusa: 3 H a per row and ResBlock instead); one loss
                 chunk 6 C V_draft 4 (C = min(R, 1024) rows: draft and target logits and their softmaxes, recomputed
                 in backward) or, when 1024 V_draft 4 <= 64 MiB, 4 R V_draft 4 (every chunk's kept); online adds
                 the target's own forward, b T (2 I_t + 4 H) t (one layer alive, no grad).
                 Checked against a measured CPU training step on a tiny target (tests/test_plan.py): the measured peak
                 is 0.99-1.22x the formula for P-EAGLE, DSpark and Medusa; the EAGLE-3 chain keeps per-depth key/value
                 copies the formula leaves out (1.3x).
  framework      2 GiB on a GPU (CUDA context, NCCL buffers, allocator slack); 0 on CPU.
A row fits when the sum is at most 92% of the GPU's memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from models.errors import DraftheadsError
from train.losses import KEEP_LOGITS_BYTES, LOSS_CHUNK_ROWS

GIB = 2**30
GPUS = {"H100-80GB": 79.1 * GIB, "H200": 139.8 * GIB}  # what torch.cuda.mem_get_info reports as total
LAYOUTS = (("H100-80GB", 8), ("H200", 8), ("H200", 1))
STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")
HEADROOM = 0.92
FRAMEWORK_GPU = 2 * GIB


@dataclass
class Sizes:
    """What the formulae read, counted from the meta-device modules."""
    head_params: int
    head_layer_params: int  # the largest decoder layer of the head (one FSDP / ZeRO-3 gather unit)
    target_params: int
    target_layer_params: int
    frozen_params: int  # embedding + final norm + LM head (tied: once)
    hidden: int
    q: int  # heads x head_dim
    kv: int  # kv_heads x head_dim
    mlp: int
    target_mlp: int
    num_aux: int
    head_layers: int
    vocab_draft: int
    target_bytes: int  # bytes per target parameter


def meta_modules(cfg):
    """(target, head) on the meta device: only shapes exist."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.checkpoint import build_draft
    from models.draft_vocab import DraftVocab
    from models.target import Target, _parse_dtype

    config = AutoConfig.for_model(**_target_config(cfg))
    dtype = _parse_dtype(cfg.target.dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        target = Target(model, None, cfg.target.name, tuple(cfg.target.layer_ids) if cfg.target.layer_ids else None)
        d = cfg.draft
        vocab = None
        if d.draft_vocab_size is not None and d.draft_vocab_size < target.vocab_size:
            vocab = DraftVocab(torch.arange(d.draft_vocab_size), target.vocab_size)
        head = build_draft(d.family, target, d.k, d.num_layers, d.parallel, vocab, d.share_lm_head, dict(d.extra))
    return target, head


def _target_config(cfg) -> dict:
    """The target's config.json: target.config, else the one beside its weights; the tiny target builds its own."""
    from models.target import TINY_TARGET, resolve_target_dir, tiny_random_llama

    if cfg.target.config:
        path = Path(cfg.target.config)
        if not path.is_file():
            raise DraftheadsError(f"target.config '{path}' does not exist; point it at the target's config.json")
        return json.loads(path.read_text())
    if cfg.target.name == TINY_TARGET and cfg.target.path is None:
        return tiny_random_llama()[0].config.to_dict()
    return json.loads((resolve_target_dir(cfg.target.name, cfg.target.path) / "config.json").read_text())


def sizes_of(target, head) -> Sizes:
    c = target.model.config
    emb, lm = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
    frozen = emb.numel() + target.model.model.norm.weight.numel() + (0 if lm is emb else lm.numel())
    layers = getattr(head, "layers", None) or getattr(head, "blocks", None) or [head]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return Sizes(
        head_params=sum(p.numel() for p in head.parameters()),
        head_layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        target_params=sum(p.numel() for p in target.model.parameters()),
        target_layer_params=sum(p.numel() for p in target.model.model.layers[0].parameters()),
        frozen_params=frozen, hidden=c.hidden_size, q=c.num_attention_heads * head_dim,
        kv=c.num_key_value_heads * head_dim, mlp=head.config.get("intermediate_size", c.intermediate_size),
        target_mlp=c.intermediate_size, num_aux=len(target.layer_ids), head_layers=len(layers),
        vocab_draft=head.config.get("draft_vocab_size") or target.vocab_size,
        target_bytes=torch.empty(0, dtype=target.dtype).element_size())


def rows_per_token(cfg) -> float:
    """Head rows per sequence token: COD keeps ~decay^(d-1) of the tokens at depth d; block heads run whole blocks
    at anchors_per_sequence anchors (per token: anchors * K / T)."""
    k, tc = cfg.draft.k, cfg.train
    from models.families import family

    if family(cfg.draft.family).blocks:
        return tc.anchors_per_sequence * k / cfg.data.max_length
    return sum(tc.cod_decay ** d for d in range(k))


def memory(s: Sizes, cfg, strategy: str, n_gpus: int, online: bool, device: str = "cuda") -> dict[str, float]:
    """Bytes per GPU by part, for one micro-batch of train.batch_size sequences of data.max_length tokens."""
    tc = cfg.train
    w = 2 if tc.mixed_precision in ("bf16", "auto") else 4  # auto: bf16 on the GPUs this plans for
    a, t, H, P = w, s.target_bytes, s.hidden, s.head_params
    if strategy in ("single", "ddp"):
        states = 16 * P
    elif strategy == "zero2":
        states = w * P + (16 - w) * P / n_gpus
    else:
        states = 16 * P / n_gpus + 2 * w * s.head_layer_params
    if not online:
        frozen = t * s.frozen_params
    elif strategy in ("fsdp", "zero3"):
        frozen = t * s.frozen_params + t * (s.target_params - s.frozen_params) / n_gpus + 2 * t * s.target_layer_params
    else:
        frozen = t * s.target_params
    b, T = tc.batch_size, cfg.data.max_length
    c = rows_per_token(cfg)
    R = b * T * c
    acts = b * T * (s.num_aux + 1) * H * 4  # the float32 feature batch
    if cfg.draft.family == "medusa":  # ResBlocks on the target's final hidden state: input, linear, SiLU per layer
        acts += R * 3 * H * a * cfg.draft.num_layers
    else:
        per_row_layer = a * (6 * H + 5 * s.q + 2 * s.kv + 5 * s.mlp) + 12 * H
        acts += R * (per_row_layer * s.head_layers + a * H)  # + the first layer's 2H-wide input
        acts += R * H * a + b * (T * c) ** 2  # fc output per row, boolean attention mask
    chunk = min(R, LOSS_CHUNK_ROWS)
    kept = LOSS_CHUNK_ROWS * s.vocab_draft * 4 <= KEEP_LOGITS_BYTES  # every chunk's softmaxes saved for backward
    acts += 4 * R * s.vocab_draft * 4 if kept else 6 * chunk * s.vocab_draft * 4
    if online:
        acts += b * T * (2 * s.target_mlp + 4 * H) * t
    return {"model_states": states, "frozen_target": frozen, "activations": acts,
            "framework": FRAMEWORK_GPU if device == "cuda" else 0.0}


def plan(cfg) -> dict:
    target, head = meta_modules(cfg)
    s = sizes_of(target, head)
    d, tc, ac = cfg.data, cfg.train, cfg.accelerate
    world = ac.num_processes * ac.num_machines
    feature_bytes = (s.num_aux + 1) * s.hidden * 2 + 4 + 1  # aux + final hidden in bf16, int32 id, uint8 loss mask
    max_tokens = d.max_records * d.max_length
    rows = []
    for gpu, n in LAYOUTS:
        for strategy in STRATEGIES:
            row = {"gpus": f"{n}x{gpu}", "strategy": strategy}
            for mode in ("offline", "online"):
                parts = memory(s, cfg, strategy, n, mode == "online")
                total = sum(parts.values())
                row[f"{mode}_gib"] = round(total / GIB, 1)
                row[f"{mode}_fits"] = total <= HEADROOM * GPUS[gpu]
            rows.append(row)
    configured = {mode: {k: round(v / GIB, 2) for k, v in memory(
        s, cfg, ac.strategy, world, mode == "online", cfg.runtime.device).items()} for mode in ("offline", "online")}
    return {
        "target": cfg.target.name, "head": f"{cfg.draft.family} K={cfg.draft.k}, {s.head_layers} layer(s)",
        "params": {"head": s.head_params, "target": s.target_params, "frozen_read_by_head": s.frozen_params},
        "feature_bytes_per_token": feature_bytes,
        "data": {"max_tokens": max_tokens, "offline_bytes": max_tokens * feature_bytes, "online_bytes": 0,
                 # offline features are made by the whole target on each device (a sharded one cannot extract them)
                 "extraction_target_gib": round(2 * s.target_params / GIB, 1)},
        "tokens_per_optimizer_step": tc.batch_size * d.max_length * tc.grad_accum * world,
        # forward + backward over c head rows per token; online adds one no-grad forward of the whole target
        "gflop_per_token": {"head": round(6 * s.head_params * rows_per_token(cfg) / 1e9, 1),
                            "online_target": round(2 * s.target_params / 1e9, 1)},
        "configured": {"strategy": ac.strategy, "processes": world, "gib_per_process": configured},
        "table": rows,
    }


def print_plan(cfg) -> dict:
    p = plan(cfg)
    tb = 1e12
    print(f"[draftheads] plan for {p['target']}: head {p['head']}")
    print(f"  parameters: head {p['params']['head'] / 1e9:.3f} B trainable, target {p['params']['target'] / 1e9:.2f} B "
          f"(the head reads {p['params']['frozen_read_by_head'] / 1e9:.2f} B of it: embedding, norm, LM head)")
    print(f"  features: {p['feature_bytes_per_token']:,} bytes/token offline; {p['data']['max_tokens'] / 1e6:,.0f} M "
          f"tokens at most (data.max_records x data.max_length) = {p['data']['offline_bytes'] / tb:,.2f} TB offline, "
          "0 online (the target runs in the training step)")
    print(f"  tokens per optimizer step: {p['tokens_per_optimizer_step']:,} (batch x length x grad_accum x processes)")
    g = p["gflop_per_token"]
    print(f"  compute per token: head {g['head']} GFLOP (forward + backward over its COD rows); online adds the "
          f"target's forward, {g['online_target']} GFLOP ({(g['head'] + g['online_target']) / g['head']:.1f}x)")
    c = p["configured"]
    for mode in ("offline", "online"):
        parts = ", ".join(f"{k} {v}" for k, v in c["gib_per_process"][mode].items())
        print(f"  configured ({c['strategy']}, {c['processes']} process(es)), {mode}: GiB per process: {parts}")
    print("\n| GPUs | strategy | offline GiB/GPU | fits | online GiB/GPU | fits |\n|---|---|---|---|---|---|")
    for r in p["table"]:
        print(f"| {r['gpus']} | {r['strategy']} | {r['offline_gib']} | {'yes' if r['offline_fits'] else 'NO'} | "
              f"{r['online_gib']} | {'yes' if r['online_fits'] else 'NO'} |")
    print(f"\nverdict (a row fits at <= {HEADROOM:.0%} of the GPU's memory):")
    for mode in ("offline", "online"):
        fits = [f"{r['gpus']} {r['strategy']}" for r in p["table"] if r[f"{mode}_fits"]]
        print(f"  {mode}: {'fits on ' + ', '.join(fits) if fits else 'DOES NOT FIT on any of these layouts'}")
    print(f"  offline rows train from features made first by the whole target on each device "
          f"({p['data']['extraction_target_gib']} GiB of bf16 weights; a sharded target cannot extract them): "
          "where no device holds it, train online")
    print(json.dumps(p))
    return p
