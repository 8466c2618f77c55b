"""Llama building blocks shared by the target-side runtime (inference/llama.py) and the draft heads."""

import torch
from torch import Tensor, nn


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm: statistics in float32, scale in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    """RoPE's pairing of the two halves of the head dim: [x1, x2] -> [-x2, x1]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TrainableHead(nn.Module):
    """Base of every draft head family. `head(batch, plan)` returns train_forward's rows; `head(batch, plan, objective)`
    also runs objective(head, rows) inside the same forward call, so a sharding wrapper (FSDP, ZeRO-3) keeps every
    parameter gathered while the loss reads it (a draft-vocab LM head, the Markov bias, the confidence head)."""

    def forward(self, batch: dict, plan, objective=None):
        rows = self.train_forward(batch, plan)
        return rows if objective is None else objective(self, rows)
