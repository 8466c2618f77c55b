"""Time every linear of a SmolLM2-135M-shaped forward (random weights) per input row count and GEMM path:
F.linear float32 and bfloat16, and both packed for oneDNN (`inference.llama.pack_for_cpu`, what the runtime uses).
Shows why verifying K drafts costs what it costs on a CPU. Prints a table, then one JSON line.

    python -m eval.linear_bench --threads 2 --rows 1,2,4,9,17,256
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eval.machine import machine_info
from inference.llama import linear, pack_for_cpu

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30


def time_forward(weights: list[torch.Tensor], in_sizes: list[int], rows: int, dtype: torch.dtype, reps: int) -> float:
    inputs = {n: torch.randn(rows, n, dtype=dtype) for n in set(in_sizes)}
    for w, n in zip(weights, in_sizes):  # warm-up
        linear(inputs[n], w)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for w, n in zip(weights, in_sizes):
            linear(inputs[n], w)
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,5,9,17,256")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_info()
    shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
              (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS + [(VOCAB, HIDDEN)]
    dense = [torch.randn(o, i) * 0.02 for o, i in shapes]
    in_sizes = [i for _, i in shapes]
    paths = {
        "float32 F.linear": (dense, torch.float32),
        "float32 packed": ([pack_for_cpu(w) for w in dense], torch.float32),
        "bfloat16 F.linear": ([w.bfloat16() for w in dense], torch.bfloat16),
        "bfloat16 packed": ([pack_for_cpu(w.bfloat16()) for w in dense], torch.bfloat16),
    }
    rows = [int(r) for r in args.rows.split(",")]
    ms = {name: [round(time_forward(ws, in_sizes, r, dt, args.reps), 1) for r in rows]
          for name, (ws, dt) in paths.items()}
    print(f"{'ms per forward':18s}" + "".join(f"{r:>8d}" for r in rows))
    for name, values in ms.items():
        print(f"{name:18s}" + "".join(f"{v:8.1f}" for v in values))
    print(json.dumps({"bench": "linear", "threads": args.threads, "rows": rows, "ms_per_forward": ms,
                      "linears": len(shapes), "parameters": sum(o * i for o, i in shapes), "machine": machine}))


if __name__ == "__main__":
    from models.errors import exit_on_error

    exit_on_error(main)
