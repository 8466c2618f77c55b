"""What a benchmark ran on: the `"machine"` field of every benchmark's JSON line.

Figures from different days compare only through it. The lent 2-core machine changes between sessions: an AMD CPU
without AMX on one day, an Intel one with AMX on another, where bfloat16 GEMMs ran 3-6x faster but tokenizing,
elementwise ops and Python ran ~1.4-1.8x slower. So the field holds the CPU, its bf16 instructions, the load average
when the benchmark started (what else ran), OpenMP's wait policy, whether the runtime's compiled CPU kernels ran
(`cpu_kernels`: off without a C compiler or with DRAFTHEADS_CPU_KERNELS=0), and four probes timed at the benchmark's
thread count (~2 s in all):

- `bf16_gemm_gflops` / `fp32_gemm_gflops`: a 64 x 576 x 1536 matmul (a decode step's MLP on SmolLM2);
- `copy_gbps`: a 64 MB float32 copy (what elementwise ops and the loss over logits are bound by);
- `python_ns_per_iter`: a pure-Python loop (tokenizer glue, schedulers, draft-file hashing).
"""

from __future__ import annotations

import os
import platform
import time

import torch

from inference import cpu_kernels, host_memory


def _best_seconds(fn, budget_s: float = 0.2) -> float:
    """The fastest of repeated calls within about budget_s, after as long of warm-up calls (the first calls in a
    process wait for the thread pool, page faults and kernel selection: half the GEMM rate here)."""
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s:
        fn()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def machine_info() -> dict:
    m, k, n = 64, 576, 1536
    gemm = {}
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        gemm[dtype] = round(2 * m * k * n / _best_seconds(lambda: torch.nn.functional.linear(a, b)) / 1e9, 1)
    src = torch.ones(16 << 20)
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src)) / 1e9

    def loop():
        total = 0
        for i in range(100_000):
            total += i ^ 7
        return total

    return {"cpu": _cpu_model(), "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "bf16_isa": list(cpu_kernels.bf16_instructions()),
            "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"), "malloc": host_memory.policy(),
            "cpu_kernels": cpu_kernels.enabled(),
            "bf16_gemm_gflops": gemm[torch.bfloat16], "fp32_gemm_gflops": gemm[torch.float32],
            "copy_gbps": round(copy_gbps, 1), "python_ns_per_iter": round(_best_seconds(loop) / 100_000 * 1e9, 1),
            "torch": torch.__version__}
