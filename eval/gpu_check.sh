#!/usr/bin/env bash
# GPU measurement of the runtime and of training, in under 10 minutes on one GPU, offline (no registry).
#
#   bash eval/gpu_check.sh [OUT_DIR]          # default $OUT/gpu_check (the device tool's folder), else outputs/gpu_check
#
# Needs a python3 with CUDA torch, triton, transformers, pytest (the GPU image has them); the repo runs from
# source (PYTHONPATH), nothing is installed but Hydra for the training steps: `make gpu-wheels` puts it in .whl/,
# which an offline machine needs beside the checkout (the device tool: carry [".whl"]). Target: $TARGET_PATH (a
# saved SmolLM2 directory) if given, else the converted cache of this project if present, else random weights with
# SmolLM2-135M's shapes (`random-smollm2-shape`: per-step costs are real, acceptance is not). Prompts: $PROMPTS,
# else eval/data (the repository's copy). Every step has its own timeout; a failing step is reported, the rest run.
# Writes OUT_DIR/<step>.log and OUT_DIR/summary.jsonl (the last JSON line of each benchmark); prints one JSON line
# last (steps run, failed). Step timeouts add up to 590 s at most.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda} MAX_NEW=${MAX_NEW:-64} LIMIT=${LIMIT:-4}  # smaller values: a smoke run of this script
OUT=${1:-${OUT:+$OUT/gpu_check}}
OUT=${OUT:-outputs/gpu_check}
failed=()
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
  [ $rc -ne 0 ] && tail -5 "$OUT/$name.log" && failed+=("$name")
  return 0
}

step env 20 $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, \
transformers.__version__, torch.cuda.get_device_name(0))"
# training reads Hydra's schemas: when the image lacks them, hydra-core / omegaconf come from a wheel directory
# ($WHEELS, else .whl/ from `make gpu-wheels`, carried with the checkout, else shared/wheels inside it) into a
# directory on PYTHONPATH (the image's site-packages may be read-only), and antlr4 4.9 (an sdist only, which pip cannot
# build without setuptools) from its unpacked source, ahead of any other antlr4 the image has (omegaconf 2.3's grammar
# fails under 4.10+). The deps step reports the outcome.
WHEELS=${WHEELS:-}
for w in .whl shared/wheels; do [ -z "$WHEELS" ] && [ -d "$w" ] && WHEELS=$w; done
if ! $PY -c "import hydra" 2>/dev/null && [ -n "$WHEELS" ]; then
  site=${TMPDIR:-/tmp}/draftheads_site
  mkdir -p "$site" && export PYTHONPATH="$PYTHONPATH:$site"
  antlr=$(ls "$WHEELS"/antlr4-python3-runtime-*.tar.gz 2>/dev/null | head -1)
  if [ -n "$antlr" ]; then
    tar xzf "$antlr" -C "$site"
    src=$(ls -d "$site"/antlr4-python3-runtime-*/src | head -1)
    export PYTHONPATH="$PYTHONPATH:$src"
  fi
  $PY -m pip install -q --no-index --no-deps --target "$site" --find-links "$WHEELS" hydra-core omegaconf \
    > "$OUT/deps.log" 2>&1
fi
step deps 20 $PY -c "import json, hydra, omegaconf, antlr4; print(json.dumps({'hydra': hydra.__version__, \
'omegaconf': omegaconf.__version__}))"
# the C kernels the runtime's CPU tests assert were built (a copy of the working tree has no compiled .so)
step build 40 $PY setup.py -q build_ext --inplace
# kernels vs references on the GPU, and the CPU test suite of the runtime under this image's torch
step kernels 30 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py
step unit 45 $PY -m pytest -q -p no:cacheprovider tests/test_runtime.py tests/test_tree.py tests/test_schedulers.py
step kernel_bench 20 $PY -c "
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
# eager float32: our plain/spec vs HF generate (plain_equals_hf_greedy: reported), spec == plain checked; eager steps
# are launch-bound (~1,500 kernels a token), so one repeat
step eager_fp32 50 $PY -m eval.speedup $COMMON --dtype float32 --max-new $MAX_NEW --limit $LIMIT --repeats 1 \
  --modes plain,spec,hf_generate --check-lossless
# CUDA graphs for decode/verify (captured per shape, seconds to build), float32 and bf16
step graphs_fp32 40 $PY -m eval.speedup $COMMON --dtype float32 --max-new $MAX_NEW --limit $LIMIT --cuda-graphs \
  --modes plain,spec --repeats 2 --check-lossless
step graphs_bf16 35 $PY -m eval.speedup $COMMON --dtype bfloat16 --max-new $MAX_NEW --limit $LIMIT --cuda-graphs \
  --modes plain,spec --repeats 2 --check-lossless
# bf16 verify steps of 17 tokens (32 with graphs' power-of-two widths): does the GPU's GEMM round a row the same
# for every row count? (the CPU's row blocking does not run on the GPU; the runtime turns off cuBLAS's reduced-
# precision split-K reductions; eager, no graphs)
step bf16_k16 35 $PY -m eval.speedup $COMMON --dtype bfloat16 --max-new $MAX_NEW --limit $LIMIT --k 16 --repeats 1 \
  --modes plain,spec --check-lossless
# batch 8 (one category, so batches are full: cache rows read as one slice) with per-request draft lengths,
# grouped by the profiled verify cost
step batch8_graphs 40 $PY -m eval.speedup $COMMON --categories qa --dtype float32 --max-new $MAX_NEW --limit 16 \
  --batch 8 --cuda-graphs --modes plain,spec --repeats 2 --check-lossless
# torch.compile(mode="reduce-overhead") last: its compile time is the least predictable (one compile per width)
step compile_fp32 90 $PY -m eval.speedup $COMMON --dtype float32 --max-new 16 --limit 1 --repeats 1 --compile \
  --modes plain,spec --check-lossless
# training on the GPU (bf16 autocast): tokens/s and peak memory next to the dry-run plan's estimate, then the same
# through accelerate's FSDP2 path (one process: the wrapped forward, full state dict gathered for saving)
TRAIN="--device cuda --mixed-precision bf16 --family peagle --layers 1 --k 8 --batch 8 --length 2048 --steps 10 --threads 4"
step train_single 40 $PY -m eval.train_bench $TARGET_ARGS $TRAIN
step train_online 40 $PY -m eval.train_bench $TARGET_ARGS $TRAIN --online
step train_fsdp 45 $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m eval.train_bench $TARGET_ARGS \
  $TRAIN --strategy fsdp
echo "== done in $(( $(date +%s) - start ))s; summary: $OUT/summary.jsonl"
names=""
[ ${#failed[@]} -gt 0 ] && names=$(printf '"%s",' "${failed[@]}")
echo "{\"benchmark\": \"gpu_check\", \"seconds\": $(( $(date +%s) - start )), \"results\": $(wc -l < "$OUT/summary.jsonl"), \"failed\": [${names%,}], \"out\": \"$OUT\"}"
