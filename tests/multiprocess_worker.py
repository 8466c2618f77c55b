"""One rank of tests/test_multiprocess.py: train a tiny head with the real train_draft and record which micro-batches
(and sequence ids) this rank read.

    python tests/multiprocess_worker.py OUT GRAD_ACCUM single                       # 1 process
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/multiprocess_worker.py OUT GRAD_ACCUM ddp
"""

import json
import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conf.schema import Config  # noqa: E402
from models.target import Target, tiny_random_llama  # noqa: E402
from train import trainer  # noqa: E402


def features(target, n=10, T=40):
    """Periodic token streams (as tests/test_trainer.py tiny_features): something definite to learn."""
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(n):
        period = int(torch.randint(2, 6, (1,), generator=g))
        ids = torch.randint(0, 256, (period,), generator=g).repeat(T // period + 1)[:T]
        out = target(ids[None])
        mask = torch.arange(T) >= 4
        items.append({"input_ids": ids, "loss_mask": mask, "aux_hidden": out.aux_hidden[0].float(),
                      "final_hidden": out.final_hidden[0].float()})
    return items


def main(out: str, grad_accum: int, strategy: str) -> None:
    torch.set_num_threads(1)
    model, tok = tiny_random_llama(num_layers=6, seed=1)
    target = Target(model, tok, "tiny-random-llama")
    cfg = OmegaConf.structured(Config)
    cfg.name, cfg.output_dir, cfg.target.name = "mp", out, "tiny-random-llama"
    cfg.draft.k, cfg.draft.num_layers = 3, 1
    cfg.accelerate.strategy = strategy
    for key, v in dict(steps=8, batch_size=2, grad_accum=grad_accum, lr=1e-2, warmup_steps=2, checkpoint_every=4,
                       log_every=1, holdout_sequences=3, eval_every=4).items():
        cfg.train[key] = v
    seen, real = [], trainer.batch_indices

    def recording(micro, batch_size, n, seed):
        ids = real(micro, batch_size, n, seed)
        seen.append({"micro": micro, "ids": ids})
        return ids

    trainer.batch_indices = recording
    trainer.train_draft(cfg, target, features(target), out)
    rank = int(os.environ.get("RANK", "0"))
    Path(out, f"batches_rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
