"""The runtime's CPU kernels (inference/_cpu_kernels.c): decode / verify attention, RMSNorm and RoPE.

MatmulAttention (inference/llama.py) gets a row-invariant attention out of GEMMs: queries padded to 8 rows, keys
padded to 512 slots, float32 copies of the keys and values, about a dozen torch ops per layer. On a 2-core CPU those
ops cost ~3x their arithmetic (11.3 of a 54 ms SmolLM2 bf16 decode step). The kernel computes each query on its own,
over only the keys its mask shows, in slot order, so its output is row-invariant by construction, and it reads
bfloat16 keys and values as they are. Where the extension was not compiled (no C compiler at install), or on a GPU,
the runtime keeps MatmulAttention. The two agree to float32 rounding, not bitwise, so one process uses one of them
for its decoding and its verification alike (the lossless check compares those).

RMSNorm and RoPE are a SmolLM2 layer's other small ops: eight and six torch calls each, ~25 us a call on this CPU
against ~4 us for one compiled call. RoPE gives bitwise torch's result; RMSNorm sums its squares in another order
(float32 rounding apart), row by row like the attention."""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    from inference import _cpu_kernels as _c
except ImportError:  # no C compiler at install time
    _c = None


def enabled() -> bool:
    """Compiled, and not turned off with DRAFTHEADS_CPU_KERNELS=0 (to compare against torch's path; benchmarks record
    this in their `machine` field)."""
    return _c is not None and os.environ.get("DRAFTHEADS_CPU_KERNELS", "1") != "0"


def supported(device: torch.device, dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int,
              hidden: int) -> bool:
    """Whether the kernels serve a model of these shapes: enabled, on the CPU, float32 or bfloat16, sizes in 8s, head
    dim at most 256."""
    return (enabled() and torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and num_heads % kv_heads == 0 and head_dim % 8 == 0 and head_dim <= 256 and hidden % 8 == 0)


def _bf16(x: Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """models.layers.rms_norm (no autograd), weight contiguous in x's dtype."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _c.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], _bf16(x), eps)
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin for x [B, H, T, hd] (last dim contiguous) and cos / sin [B, 1, T, hd], bitwise;
    returns [B, H, T, hd] as a view of a contiguous [B, T, H, hd] (what the attention's output projection reads)."""
    B, H, T, hd = x.shape
    cos, sin = cos.expand(B, 1, T, hd), sin.expand(B, 1, T, hd)  # the rotary's rows: last dim contiguous
    out = torch.empty(B, T, H, hd, dtype=x.dtype)
    _c.rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), B, H, T, hd, x.stride(0), x.stride(1),
            x.stride(2), cos.stride(0), cos.stride(2), _bf16(x))
    return out.transpose(1, 2)


class CompiledAttention:
    """Decode / verify attention for one forward, mask [B, 1, T, S] bool (called as MatmulAttention is):
    per layer q [B, nh, T, hd], keys / values [B, kvh, S, hd] (a span of the cache) -> [B, nh, T, hd] in q's dtype."""

    def __init__(self, mask: Tensor, head_dim: int):
        self.mask = mask.contiguous()
        self.scale = head_dim**-0.5

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        B, nh, T, hd = q.shape
        kvh, S = keys.shape[1], keys.shape[2]
        for name, x in (("q", q), ("keys", keys), ("values", values)):
            if x.dtype != q.dtype or x.stride(-1) != 1 or (name != "q" and x.stride(-2) != hd):
                raise ValueError(f"CompiledAttention: {name} {x.dtype} with strides {x.stride()} is not laid out as "
                                 "the KV cache lays it out (slot stride head_dim, element stride 1)")
        out = torch.empty(B, T, nh, hd, dtype=q.dtype)
        _c.attend(q.data_ptr(), keys.data_ptr(), values.data_ptr(), self.mask.data_ptr(), out.data_ptr(),
                  B, nh, kvh, T, S, hd, q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1),
                  values.stride(0), values.stride(1), self.mask.stride(0), self.mask.stride(2), _bf16(q), self.scale)
        return out.transpose(1, 2)
