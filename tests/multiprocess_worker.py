"""One rank of tests/test_multiprocess.py: train a tiny head with the real train_draft and record which micro-batches
(and sequence ids) this rank read.

    python tests/multiprocess_worker.py OUT GRAD_ACCUM single [online]              # 1 process
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/multiprocess_worker.py OUT GRAD_ACCUM ddp

`online`: the items carry tokens only and the target computes hidden states in the step; under zero3 the target's
decoder layers are FSDP2-sharded over the ranks.
"""

import json
import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conf.schema import Config  # noqa: E402
from models.target import Target, _shard_layers, tiny_random_llama  # noqa: E402
from train import trainer  # noqa: E402
from train.distributed import make_accelerator  # noqa: E402


def features(target, n=10, T=40, hidden=True):
    """Periodic token streams (as tests/test_trainer.py tiny_features): something definite to learn."""
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(n):
        period = int(torch.randint(2, 6, (1,), generator=g))
        ids = torch.randint(0, 256, (period,), generator=g).repeat(T // period + 1)[:T]
        mask = torch.arange(T) >= 4
        items.append({"input_ids": ids, "loss_mask": mask})
        if hidden:
            out = target(ids[None])
            items[-1] |= {"aux_hidden": out.aux_hidden[0].float(), "final_hidden": out.final_hidden[0].float()}
    return items


def main(out: str, grad_accum: int, strategy: str, online: bool) -> None:
    torch.set_num_threads(1)
    cfg = OmegaConf.structured(Config)
    cfg.name, cfg.output_dir, cfg.target.name = "mp", out, "tiny-random-llama"
    cfg.draft.k, cfg.draft.num_layers = 3, 1
    cfg.accelerate.strategy = strategy
    for key, v in dict(steps=8, batch_size=2, grad_accum=grad_accum, lr=1e-2, warmup_steps=2, checkpoint_every=4,
                       log_every=1, holdout_sequences=3, eval_every=4).items():
        cfg.train[key] = v
    accelerator = make_accelerator(cfg.accelerate, cfg.train, "cpu")
    model, tok = tiny_random_llama(num_layers=6, seed=1)
    sharded = online and strategy == "zero3"
    if sharded:
        _shard_layers(model)
    target = Target(model, tok, "tiny-random-llama", sharded=sharded)
    seen, real = [], trainer.batch_indices

    def recording(micro, batch_size, n, seed, lengths=None):
        ids = real(micro, batch_size, n, seed, lengths)
        seen.append({"micro": micro, "ids": ids})
        return ids

    trainer.batch_indices = recording
    trainer.train_draft(cfg, target, features(target, hidden=not online), out, accelerator=accelerator)
    rank = int(os.environ.get("RANK", "0"))
    Path(out, f"batches_rank{rank}.json").write_text(json.dumps(seen))


def sharded_target(model_dir: str, out: str, strategy: str) -> None:
    """`target MODEL_DIR OUT STRATEGY`: the target loaded whole, FSDP2-sharded from its files, and as head inputs
    only, under the Accelerator of accelerate.strategy; writes how far the sharded forward is from the whole one and
    what each rank holds."""
    from models.target import load_target

    cfg = OmegaConf.structured(Config)
    cfg.accelerate.strategy = strategy
    make_accelerator(cfg.accelerate, cfg.train, "cpu")

    whole, sharded = load_target("x", model_dir), load_target("x", model_dir, shard=True)
    light = load_target("x", model_dir, parts="head_inputs")
    rank = int(os.environ.get("RANK", "0"))
    ids = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(rank))
    a, b = whole(ids), sharded(ids)
    local = sum(p.to_local().numel() for p in sharded.model.model.layers.parameters())
    Path(out, f"target_rank{rank}.json").write_text(json.dumps({
        "aux": float((a.aux_hidden - b.aux_hidden).abs().max()), "logits": float((a.logits - b.logits).abs().max()),
        "layer_params_here": local, "layer_params": sum(p.numel() for p in whole.model.model.layers.parameters()),
        "light_meta_layers": all(p.is_meta for p in light.model.model.layers.parameters()),
        "light_lm_head_equal": torch.equal(light.model.lm_head.weight, whole.model.lm_head.weight)}))


def uneven_chunks(out: str, parallel: str) -> None:
    """`chunks OUT parallel|chain|medusa`: ZeRO-3 with a head that owns its LM head (a draft vocabulary, as
    peagle_70b's), on sequences of very different lengths (one shorter than K + 2 tokens), so the ranks' loss and
    validation chunks, and a chain head's depths, differ in number; writes each rank's row counts."""
    from train import chain

    torch.set_num_threads(1)
    trainer.LOSS_CHUNK_ROWS = chain.LOSS_CHUNK_ROWS = 16  # stands in for 1024 rows at 2048 tokens
    trainer.KEEP_LOGITS_BYTES = 8 * 128 * 4  # a full chunk's logits are recomputed in backward, a short one's were kept
    cfg = OmegaConf.structured(Config)
    cfg.name, cfg.output_dir, cfg.target.name = "chunks", out, "tiny-random-llama"
    cfg.draft.k, cfg.draft.num_layers, cfg.draft.draft_vocab_size = 3, 1, 128
    cfg.draft.parallel = parallel != "chain"
    if parallel == "medusa":
        cfg.draft.family = "medusa"
    cfg.accelerate.strategy, cfg.accelerate.timeout_minutes = "zero3", 1
    for key, v in dict(steps=2, batch_size=1, grad_accum=1, lr=1e-2, warmup_steps=1, checkpoint_every=100,
                       log_every=1, holdout_sequences=2, eval_every=2).items():
        cfg.train[key] = v
    accelerator = make_accelerator(cfg.accelerate, cfg.train, "cpu")
    model, tok = tiny_random_llama(num_layers=2, seed=1)
    target = Target(model, tok, "tiny-random-llama")
    g = torch.Generator().manual_seed(0)
    items = []
    for T in (4, 57, 8, 50, 15, 43, 22, 36):  # micro-batch m of rank r reads sequence 2m + r (or its shuffle)
        ids = torch.randint(0, 250, (T,), generator=g)
        o = target(ids[None])
        items.append({"input_ids": ids, "loss_mask": torch.arange(T) >= 2, "aux_hidden": o.aux_hidden[0].float(),
                      "final_hidden": o.final_hidden[0].float()})
    rows, real = [], trainer._objective

    def counting(core, target_, batch, out_, *args, **kw):
        rows.append(out_.hidden.shape[0])
        return real(core, target_, batch, out_, *args, **kw)

    trainer._objective = counting
    trainer.train_draft(cfg, target, items, out, accelerator=accelerator)
    Path(out, f"rows_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    if sys.argv[1] == "target":
        sharded_target(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "chunks":
        uneven_chunks(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:] == ["online"])
