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
        rows = self.train_forward(self.features_in_own_dtype(batch), plan)
        return rows if objective is None else objective(self, rows)

    def features_in_own_dtype(self, batch: dict) -> dict:
        """The batch with its target features in the head's parameter dtype when no autocast does it: DeepSpeed's
        bf16 casts the head itself and turns autocast off, while features are decoded as float32."""
        dtype = next(self.parameters()).dtype
        if torch.is_autocast_enabled(batch["aux_hidden"].device.type) or batch["aux_hidden"].dtype == dtype:
            return batch
        return {**batch, **{k: batch[k].to(dtype) for k in ("aux_hidden", "final_hidden") if k in batch}}
