#!/usr/bin/env bash
# The head comparisons of issues #3 and #6 on the default target, one heavy job at a time, every head on the same
# regenerated ShareGPT slice and budget (the settings of conf/experiment/peagle_smollm2.yaml):
#   JOBS="peagle dspark dflash rnn medusa eagle3 rl rl_strong rl_greedy rl_t1 anneal" bash eval/compare_heads.sh
# EXTRA="train.mixed_precision=bf16 ..." adds overrides to every job; ROOT picks the output tree (default outputs/cmp).
# P-EAGLE-family heads share outputs/cmp/data3 (features of 3 target layers); DSpark-family heads share
# outputs/cmp/data5 (5 layers; the regenerated text is copied over, so only the features are recomputed).
# τ tables: outputs/cmp/NAME/eval/summary.md. Measured results: README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE  # spin-waiting threads thrash 2 cores when anything else runs
PY=${PY:-.venv/bin/python}
ROOT=${ROOT:-outputs/cmp}
COMMON=(train.steps="${STEPS:-600}" eval.limit="${LIMIT:-16}" "eval.temperatures=[0.0,1.0]" runtime.threads="${THREADS:-2}"
        ${EXTRA:-})

data() {  # data3 | data5: the shared data stage, once
  local dir=$ROOT/$1 exp=peagle_smollm2
  [ "$1" = data5 ] && exp=dspark_smollm2
  [ -f "$dir/data/data_report.json" ] && return
  mkdir -p "$dir/data"
  [ "$1" = data5 ] && [ -f "$ROOT/data3/data/regenerated.jsonl" ] && cp "$ROOT/data3/data/regenerated.jsonl" "$dir/data/"
  $PY -m train.distill +experiment=$exp output_dir="$dir" "train.stages=[]" eval.limit=0 > "$dir/log.txt" 2>&1
}

run() {  # name data overrides...
  local name=$1 shared=$2 out=$ROOT/$1
  shift 2
  data "$shared"
  mkdir -p "$out"
  [ -e "$out/data" ] || ln -s "../$shared/data" "$out/data"
  [ -f "$out/run_report.json" ] && { echo "== $name: done before"; return; }
  echo "== $name ($(date -u +%T))"
  $PY -m train.distill output_dir="$out" "${COMMON[@]}" "$@" > "$out/log.txt" 2>&1 || echo "== $name failed: $out/log.txt"
  cat "$out/eval/summary.md" 2>/dev/null
}

for job in ${JOBS:-peagle dspark dflash rnn medusa eagle3 rl rl_strong anneal}; do
  case $job in
    peagle) run peagle data3 +experiment=peagle_smollm2 "eval.k=[5,7,8]" "eval.sources=[prompt_lookup]" ;;
    medusa) run medusa data3 +experiment=medusa_smollm2 "eval.sources=[]" ;;
    eagle3) run eagle3 data3 +experiment=eagle3_smollm2 "eval.sources=[]" ;;
    anneal) run anneal data3 +experiment=peagle_smollm2 "eval.sources=[]" train.temperature.start=2.0 \
              train.temperature.end=1.0 train.temperature.schedule=cosine ;;
    rl)     run rl data3 +experiment=peagle_smollm2 "eval.sources=[]" "train.stages=[rl]" \
              draft.init_from="$ROOT/peagle/head_soft_label" train.rl_steps="${RL_STEPS:-150}" train.rl_anchors=1 ;;
    rl_strong) run rl_strong data3 +experiment=peagle_smollm2 "eval.sources=[]" "train.stages=[rl]" \
              draft.init_from="$ROOT/peagle/head_soft_label" train.rl_steps=300 train.rl_lr=3e-4 \
              train.rl_kl_weight=0.02 train.rl_pg_weight=0.5 train.rl_anchors=1 ;;
    rl_greedy|rl_t1)  # 16 blocks per sequence and step; greedy: optimise T=0 acceptance, t1: T=1
              T=0.0; [ $job = rl_t1 ] && T=1.0
              run $job data3 +experiment=peagle_smollm2 "eval.sources=[]" "train.stages=[rl]" \
              draft.init_from="$ROOT/peagle/head_soft_label" train.rl_steps="${RL_STEPS:-100}" train.rl_lr=1e-4 \
              train.rl_kl_weight=0.1 train.rl_pg_weight=0.1 train.rl_anchors=16 train.rl_temperature=$T ;;
    dspark) run dspark data5 +experiment=dspark_smollm2 ;;
    dflash) run dflash data5 +experiment=dflash_smollm2 ;;
    rnn)    run rnn data5 +experiment=dspark_smollm2 draft.extra.sequential=rnn ;;
    *) echo "unknown job '$job' (peagle medusa eagle3 anneal rl rl_strong rl_greedy rl_t1 dspark dflash rnn)"; exit 2 ;;
  esac
done
