"""The runtime's CPU kernels (inference/_cpu_kernels.c): decode / verify attention, RMSNorm, RoPE and the bfloat16
linear of CPUs without native bfloat16.

MatmulAttention (inference/llama.py) gets a row-invariant attention out of GEMMs: queries padded to 8 rows, keys
padded to 512 slots, float32 copies of the keys and values, about a dozen torch ops per layer. On a 2-core CPU those
ops cost ~3x their arithmetic (11.3 of a 54 ms SmolLM2 bf16 decode step). The kernel computes each query on its own,
over only the keys its mask shows, in slot order, so its output is row-invariant by construction, and it reads
bfloat16 keys and values as they are. Where the extension was not compiled (no C compiler at install), or on a GPU,
the runtime keeps MatmulAttention. The two agree to float32 rounding, not bitwise, so one process uses one of them
for its decoding and its verification alike (the lossless check compares those).

RMSNorm and RoPE are a SmolLM2 layer's other small ops: eight and six torch calls each, ~25 us a call on this CPU
against ~4 us for one compiled call. RoPE gives bitwise torch's result; RMSNorm sums its squares in another order
(float32 rounding apart), row by row like the attention.

The bfloat16 linear: where the CPU has no bfloat16 instructions (no AVX-512 BF16 or AMX: most laptops, Intel's Xeons
before Cooper Lake / Sapphire Rapids, AMD's EPYC before Zen 4), oneDNN emulates bf16 GEMMs: ~19 GFLOP/s against ~150
for float32 on the same cores (AMD EPYC, AVX2, 2 threads), ~52 against ~174 (AVX-512 Xeon without BF16), so verifying
drafts cost 3x a decode step. The kernel reads the bf16 weights as they are (half the
bytes of float32), sums every output in float32 by fused multiply-adds in a fixed order, and rounds once: a row's
output is the same for any number of rows, which is what decoding a token alone against verifying it needs."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
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


def _openmp_runtime() -> str | None:
    """The path of the OpenMP runtime torch loaded into this process (libgomp, libiomp5 or libomp), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/lib" in line}
    except OSError:
        return None
    for name in ("libgomp", "libiomp5", "libomp"):
        for path in sorted(paths):
            if os.path.basename(path).startswith(name):
                return path
    return None


def emulates_bf16(x: Tensor) -> bool:
    """Whether x is bfloat16 on a CPU without bfloat16 instructions, where oneDNN emulates bf16 GEMMs (~3x slower than
    float32 on an AVX-512 Xeon without BF16, ~8x on an AVX2 EPYC)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not bf16_instructions()


@functools.cache
def bf16_instructions() -> tuple[str, ...]:
    """The CPU's native bfloat16 instruction sets (AVX-512 BF16, AMX) from /proc/cpuinfo; () where unknown. oneDNN's
    own check (`torch.ops.mkldnn._is_mkldnn_bf16_supported`) also says yes on AVX-512 CPUs that only emulate bf16."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return ()
    return tuple(f for f in ("avx512_bf16", "amx_bf16") if f in flags)


@functools.cache
def intel_cpu() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "GenuineIntel" in f.read(1 << 16)
    except OSError:
        return False


def bf16_trains_faster() -> bool:
    """Whether bfloat16 autocast trains a head faster than float32 on this CPU (train.mixed_precision=auto), by its
    instructions, as measured (`eval.train_bench`, the default head, 2 cores): AMX 2.15x (Intel Xeon, 2,189 vs 1,017
    tok/s); AVX-512 BF16 on AMD's Zen 4 1.34x; AVX-512 BF16 on an Intel Xeon without AMX 0.60x (457 vs 768: oneDNN's
    bf16 GEMM ran at 140 GFLOP/s there against 250 for float32); no bf16 instructions: emulated, ~3x slower. Read
    from the flags, not timed, so every process of a run and every resume of it decide alike."""
    isa = bf16_instructions()
    return "amx_bf16" in isa or ("avx512_bf16" in isa and not intel_cpu())


def serves_bf16_linear(weight: Tensor) -> bool:
    """Whether `Bf16Weight` serves this weight: bfloat16 on a CPU without bfloat16 instructions, the kernels
    enabled, AVX2 + FMA, a 2-D weight whose input size is a multiple of 8."""
    return (emulates_bf16(weight) and weight.dim() == 2 and weight.shape[1] % 8 == 0 and enabled()
            and _c.has_avx2_fma())


@functools.cache
def _on_torch_threads() -> bool:
    """Whether linear_bf16 runs on torch's OpenMP team (found once, in the runtime torch loaded)."""
    path = _openmp_runtime()
    return bool(path) and _c.use_openmp(path)


def linear_bf16(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) in bfloat16 by the compiled kernel (see the module's docstring), on torch's threads:
    x [..., K], weight [N, K] contiguous bfloat16, bias [N] or None."""
    N, K = weight.shape
    rows = x.numel() // K
    xf = x.reshape(rows, K).float()
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    out = torch.empty(rows, N, dtype=torch.bfloat16)
    _c.linear_bf16(xf.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), rows, K,
                   N, torch.get_num_threads() if _on_torch_threads() else 1)
    return out.view(*x.shape[:-1], N)


class Bf16Weight:
    """A bfloat16 weight that `inference.llama.linear` multiplies by `linear_bf16` (what `pack_for_cpu` returns where
    `serves_bf16_linear`). Forwards that need no row invariance (prefills, regeneration) and have at least
    UPCAST_ROWS rows run one float32 GEMM over a float32 copy of the weight instead: the same products and a float32
    sum, at float32 GEMM speed, for a conversion that many rows amortise."""

    UPCAST_ROWS = 256

    def __init__(self, weight: Tensor):
        self.weight = weight.detach().contiguous()

    def linear(self, x: Tensor, bias: Tensor | None, row_invariant: bool) -> Tensor:
        if not row_invariant and x.numel() // x.shape[-1] >= self.UPCAST_ROWS:
            return F.linear(x.float(), self.weight.float(), None if bias is None else bias.float()).bfloat16()
        return linear_bf16(x, self.weight, bias)


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
