#!/usr/bin/env bash
# GPU measurement of the runtime and of training, in under 10 minutes on one GPU, offline (no registry).
#
#   bash eval/gpu_check.sh [OUT_DIR]          # default outputs/gpu_check
#
# Needs a python3 with CUDA torch, triton, transformers, pytest (the GPU image has them); the repo runs from
# source (PYTHONPATH), nothing is installed. Target: $TARGET_PATH (a saved SmolLM2 directory) if given, else
# the converted cache of this project if present, else random weights with SmolLM2-135M's shapes
# (`random-smollm2-shape`: per-step costs are real, acceptance is not). Prompts: $PROMPTS, else
# eval/data (the repository's copy). Every step has its own timeout; a failing step is reported, the rest run.
# Writes OUT_DIR/<step>.log and OUT_DIR/summary.jsonl (the last JSON line of each benchmark).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda} MAX_NEW=${MAX_NEW:-128} LIMIT=${LIMIT:-8}  # smaller values: a smoke run of this script
OUT=${1:-outputs/gpu_check}
mkdir -p "$OUT"
: > "$OUT/summary.jsonl"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
export TRITON_DEFAULT_FP_FUSION=1
start=$(date +%s)

PROMPTS=${PROMPTS:-}
for p in eval/data/spec_bench_dev.jsonl shared/bench/spec_bench_dev.jsonl; do
  [ -z "$PROMPTS" ] && [ -f "$p" ] && PROMPTS=$p
done
if [ -z "$PROMPTS" ]; then echo "no prompts: set PROMPTS=/path/to/spec_bench_dev.jsonl" >&2; exit 2; fi

TARGET_ARGS="--target random-smollm2-shape"
cached=$(ls -d "${DRAFTHEADS_CACHE:-$HOME/.cache/draftheads}"/targets/SmolLM2-135M-Instruct* 2>/dev/null | head -1)
if [ -n "${TARGET_PATH:-}" ]; then TARGET_ARGS="--target smollm2-135m-instruct --target-path $TARGET_PATH"
elif [ -n "$cached" ]; then TARGET_ARGS="--target smollm2-135m-instruct --target-path $cached"; fi

step() {  # step NAME SECONDS CMD...: run with a timeout, log, keep the last JSON line
  local name=$1 secs=$2; shift 2
  echo "== $name ($(( $(date +%s) - start ))s elapsed)"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local last; last=$(grep '^{' "$OUT/$name.log" | tail -1)
  [ -n "$last" ] && echo "{\"step\": \"$name\", \"rc\": $rc, \"result\": $last}" >> "$OUT/summary.jsonl"
  echo "   rc=$rc ${last:0:400}"
  [ $rc -ne 0 ] && tail -5 "$OUT/$name.log"
  return 0
}

step env 30 $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, \
transformers.__version__, torch.cuda.get_device_name(0))"
# training reads Hydra's schemas: when the image lacks them, hydra-core / omegaconf come from a wheel directory
# ($WHEELS, else shared/wheels inside the checkout where the machine provides one) and antlr4 (an sdist only, which
# pip cannot build without setuptools) from its unpacked source on PYTHONPATH. The deps step reports the outcome.
WHEELS=${WHEELS:-}
[ -z "$WHEELS" ] && [ -d shared/wheels ] && WHEELS=shared/wheels
if ! $PY -c "import hydra" 2>/dev/null && [ -n "$WHEELS" ]; then
  antlr=$(ls "$WHEELS"/antlr4-python3-runtime-*.tar.gz 2>/dev/null | head -1)
  if ! $PY -c "import antlr4" 2>/dev/null && [ -n "$antlr" ]; then
    mkdir -p "$OUT/deps" && tar xzf "$antlr" -C "$OUT/deps"
    src=$(ls -d "$OUT"/deps/antlr4-python3-runtime-*/src | head -1)
    export PYTHONPATH="$PYTHONPATH:$(cd "$src" && pwd)"
  fi
  $PY -m pip install -q --no-index --no-deps --find-links "$WHEELS" hydra-core omegaconf > "$OUT/deps.log" 2>&1
fi
step deps 30 $PY -c "import json, hydra, omegaconf, antlr4; print(json.dumps({'hydra': hydra.__version__, \
'omegaconf': omegaconf.__version__}))"
# kernels vs references on the GPU, and the CPU test suite of the runtime under this image's torch
step kernels 40 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py
step unit 50 $PY -m pytest -q -p no:cacheprovider -x tests/test_runtime.py tests/test_tree.py tests/test_schedulers.py
step kernel_bench 25 $PY -c "
import json, torch, triton.testing as tt
from inference import kernels
B, K, V = 32, 8, 49152
logits = torch.randn(B, K + 1, V, device='cuda')
draft = logits[:, :K].argmax(-1); lens = torch.full((B,), K, device='cuda')
parents = torch.arange(63, device='cuda').repeat(B, 1) // 2 - 1
ms = lambda f: round(tt.do_bench(f), 4)
print(json.dumps({'B': B, 'K': K, 'V': V,
  'accept_greedy_ms': {'triton': ms(lambda: kernels.accept_greedy_batched(draft, lens, logits)),
                       'reference': ms(lambda: kernels.accept_greedy_reference(draft, lens, logits))},
  'tree_mask_ms': {'triton': ms(lambda: kernels.tree_masks(parents)),
                   'reference': ms(lambda: kernels.tree_masks_reference(parents))}}))
"
COMMON="$TARGET_ARGS --device $DEVICE --source prompt_lookup --prompts $PROMPTS --threads 4 --temperature 0"
# eager float32: our plain/spec vs HF generate / HF prompt lookup, lossless check
step eager_fp32 70 $PY -m eval.speedup $COMMON --dtype float32 --max-new $MAX_NEW --limit $LIMIT --check-lossless
# CUDA graphs for decode/verify (captured per shape, seconds to build), float32 and bf16
step graphs_fp32 55 $PY -m eval.speedup $COMMON --dtype float32 --max-new $MAX_NEW --limit $LIMIT --cuda-graphs \
  --modes plain,spec --check-lossless
step graphs_bf16 45 $PY -m eval.speedup $COMMON --dtype bfloat16 --max-new $MAX_NEW --limit $LIMIT --cuda-graphs --modes plain,spec \
  --check-lossless
# bf16 verify steps of 17 tokens (32 with graphs' power-of-two widths): does the GPU's GEMM round a row the same
# for every row count? (the CPU's row blocking does not run on the GPU; eager, no graphs)
step bf16_k16 45 $PY -m eval.speedup $COMMON --dtype bfloat16 --max-new $MAX_NEW --limit $LIMIT --k 16 --modes plain,spec \
  --check-lossless
# batch 8 with per-request draft lengths, grouped by the profiled verify cost
step batch8_graphs 45 $PY -m eval.speedup $COMMON --dtype float32 --max-new $MAX_NEW --limit $((2 * LIMIT)) --batch 8 --cuda-graphs \
  --modes plain,spec --check-lossless
# torch.compile(mode="reduce-overhead") last: its compile time is the least predictable
step compile_fp32 60 $PY -m eval.speedup $COMMON --dtype float32 --max-new $((MAX_NEW / 2)) --limit $((LIMIT / 2 + 1)) --compile --modes plain,spec
# training on the GPU (bf16 autocast): tokens/s and peak memory next to the dry-run plan's estimate, then the same
# through accelerate's FSDP2 path (one process: the wrapped forward, full state dict gathered for saving)
TRAIN="--device cuda --mixed-precision bf16 --family peagle --layers 1 --k 8 --batch 8 --length 2048 --steps 20 --threads 4"
step train_single 55 $PY -m eval.train_bench $TARGET_ARGS $TRAIN
step train_online 55 $PY -m eval.train_bench $TARGET_ARGS $TRAIN --online
step train_fsdp 55 $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m eval.train_bench $TARGET_ARGS \
  $TRAIN --strategy fsdp
echo "== done in $(( $(date +%s) - start ))s; summary: $OUT/summary.jsonl"
