"""The runtime's CPU kernels (inference/_cpu_kernels.c): decode / verify attention and RMSNorm.

MatmulAttention (inference/llama.py) gets a row-invariant attention out of GEMMs: queries padded to 8 rows, keys
padded to 512 slots, float32 copies of the keys and values, about a dozen torch ops per layer. On a 2-core CPU those
ops cost ~3x their arithmetic (11.3 of a 54 ms SmolLM2 bf16 decode step). The kernel computes each query on its own,
over only the keys its mask shows, in slot order, so its output is row-invariant by construction, and it reads
bfloat16 keys and values as they are. Where the extension was not compiled (no C compiler at install), or on a GPU,
the runtime keeps MatmulAttention. The two agree to float32 rounding, not bitwise, so one process uses one of them
for its decoding and its verification alike (the lossless check compares those)."""

from __future__ import annotations

import torch
from torch import Tensor

try:
    from inference._cpu_kernels import attend as _attend, rms_norm as _rms_norm
except ImportError:  # no C compiler at install time
    _attend = _rms_norm = None


def kernels_available() -> bool:
    return _attend is not None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """models.layers.rms_norm in one call, for float32 / bfloat16 CPU tensors without autograd and a hidden size that
    is a multiple of 8 (`norm_supported`): eight torch ops a call cost ~4.4 ms of a 54 ms SmolLM2 bf16 decode step.
    Each row on its own, so a row's output does not depend on the other rows."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
              int(x.dtype == torch.bfloat16), eps)
    return out


def norm_supported(weight: Tensor) -> bool:
    return (_rms_norm is not None and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.shape[-1] % 8 == 0 and weight.is_contiguous())


class CompiledAttention:
    """Decode / verify attention for one forward, mask [B, 1, T, S] bool (the same call as MatmulAttention):
    per layer q [B, nh, T, hd], keys / values [B, kvh, S, hd] (a span of the cache) -> [B, nh, T, hd] in q's dtype."""

    def __init__(self, mask: Tensor, num_heads: int, kv_heads: int, head_dim: int):
        self.mask = mask.contiguous()
        self.scale = head_dim**-0.5

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int) -> bool:
        return (_attend is not None and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                and num_heads % kv_heads == 0 and head_dim % 8 == 0)

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        B, nh, T, hd = q.shape
        kvh, S = keys.shape[1], keys.shape[2]
        for name, x in (("q", q), ("keys", keys), ("values", values)):
            if x.dtype != q.dtype or x.stride(-1) != 1 or (name != "q" and x.stride(-2) != hd):
                raise ValueError(f"CompiledAttention: {name} {x.dtype} with strides {x.stride()} is not laid out as "
                                 "the KV cache lays it out (slot stride head_dim, element stride 1)")
        out = torch.empty(B, T, nh, hd)
        _attend(q.data_ptr(), keys.data_ptr(), values.data_ptr(), self.mask.data_ptr(), out.data_ptr(),
                B, nh, kvh, T, S, hd, q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1),
                values.stride(0), values.stride(1), self.mask.stride(0), self.mask.stride(2),
                int(q.dtype == torch.bfloat16), self.scale)
        return out.to(q.dtype).transpose(1, 2)
