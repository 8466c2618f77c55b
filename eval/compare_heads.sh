#!/usr/bin/env bash
# Head comparisons on the default target, one heavy job at a time, every head on the same regenerated ShareGPT text
# and the same budget:
#   JOBS="peagle dspark dflash rnn medusa eagle3 rl rl_strong rl_greedy rl_t1 anneal" bash eval/compare_heads.sh
#   SCALE=1m JOBS="peagle eagle3 dflash dspark curve_0.125 curve_0.25 curve_0.5 rl_t1" bash eval/compare_heads.sh
#   JOBS="dspark_r64=dspark:draft.extra.rank=64 dspark_g4=dspark:draft.k=4,eval.k=[4]" bash eval/compare_heads.sh
# SCALE="" (default): the settings of conf/experiment/peagle_smollm2.yaml (1200 records), ROOT=outputs/cmp.
# SCALE=1m: the million-token recipes (conf/experiment/*_smollm2_1m.yaml: their steps, processes, 80 MT-bench
# questions), ROOT=outputs/million. EXTRA="k=v ..." adds overrides to every job.
# Heads share one regeneration (data.cache_dir keys it by the settings that shape it); heads reading the same target
# layers share features. Every job resumes where it stopped; a finished one is skipped. Seconds per job:
# $ROOT/times.jsonl; τ tables: $ROOT/NAME/eval/summary.md. Measured results: README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE  # spin-waiting threads thrash 2 cores when anything else runs
# memory: train.distill re-executes itself under mimalloc (inference/host_memory.py), which reuses freed blocks without
# glibc's page faults or heap growth; a MALLOC_* variable or DRAFTHEADS_MALLOC=glibc set here keeps glibc.
PY=${PY:-.venv/bin/python}
SCALE=${SCALE:-}
SUFFIX=${SCALE:+_$SCALE}
if [ -z "$SCALE" ]; then
  ROOT=${ROOT:-outputs/cmp}
  COMMON=(train.steps="${STEPS:-600}" eval.limit="${LIMIT:-16}" data.cache_dir="$ROOT/data_cache")
  PEAGLE_K="[5,7,8]"
else
  ROOT=${ROOT:-outputs/million}
  COMMON=(${STEPS:+train.steps=$STEPS} ${LIMIT:+eval.limit=$LIMIT})
  PEAGLE_K="[5]"
fi
COMMON+=("eval.temperatures=[0.0,1.0]" runtime.threads="${THREADS:-2}" ${EXTRA:-})

run() {  # name overrides...
  local name=$1 out=$ROOT/$1 t0=$SECONDS
  shift
  mkdir -p "$out"
  [ -f "$out/run_report.json" ] && { echo "== $name: done before"; return; }
  echo "== $name ($(date -u +%T))"
  if $PY -m train.distill output_dir="$out" "${COMMON[@]}" "$@" > "$out/log.txt" 2>&1; then
    echo "{\"job\": \"$name\", \"seconds\": $((SECONDS - t0)), \"scale\": \"${SCALE:-default}\"}" >> "$ROOT/times.jsonl"
  else
    echo "== $name failed: $out/log.txt"
  fi
  cat "$out/eval/summary.md" 2>/dev/null
}

rl() {  # name T overrides...: stage 2 alone from the P-EAGLE job's stage-1 head
  local name=$1 T=$2
  shift 2
  run "$name" "+experiment=peagle_smollm2$SUFFIX" "eval.sources=[]" "train.stages=[rl]" \
    draft.init_from="$ROOT/peagle/head_soft_label" train.rl_temperature="$T" "$@"
}

for job in ${JOBS:-peagle dspark dflash rnn medusa eagle3 rl rl_strong anneal}; do
  case $job in
    peagle) run peagle "+experiment=peagle_smollm2$SUFFIX" "eval.k=$PEAGLE_K" "eval.sources=[prompt_lookup]" ;;
    medusa|eagle3) run $job "+experiment=${job}_smollm2$SUFFIX" "eval.sources=[]" ;;
    anneal) run anneal +experiment=peagle_smollm2 "eval.sources=[]" train.temperature.start=2.0 \
              train.temperature.end=1.0 train.temperature.schedule=cosine ;;
    curve_*)  # P-EAGLE on the first fraction of the training sequences, same steps and held-out set
            run $job "+experiment=peagle_smollm2$SUFFIX" train.data_fraction="${job#curve_}" "eval.sources=[]" \
              "eval.k=[5]" "eval.temperatures=[0.0]" eval.head_tree=false ;;
    rl)     rl rl null train.rl_steps="${RL_STEPS:-150}" train.rl_anchors=1 ;;
    rl_strong) rl rl_strong null train.rl_steps=300 train.rl_lr=3e-4 train.rl_kl_weight=0.02 train.rl_pg_weight=0.5 \
              train.rl_anchors=1 ;;
    rl_greedy|rl_t1)  # 16 blocks per sequence and step; greedy: optimise T=0 acceptance, t1: T=1
            T=0.0; [ $job = rl_t1 ] && T=1.0
            rl $job $T train.rl_steps="${RL_STEPS:-100}" train.rl_lr=1e-4 train.rl_kl_weight=0.1 train.rl_pg_weight=0.1 \
              train.rl_anchors=16 ;;
    dspark|dflash) run $job "+experiment=${job}_smollm2$SUFFIX" ;;
    rnn)    run rnn "+experiment=dspark_smollm2$SUFFIX" draft.extra.sequential=rnn ;;
    *=*:*)  # an ablation: NAME=FAMILY:k=v,k=v (e.g. dspark_r64=dspark:draft.extra.rank=64,train.anchors_per_sequence=32)
            name=${job%%=*} spec=${job#*=}
            IFS=, read -ra overrides <<< "${spec#*:}"
            run "$name" "+experiment=${spec%%:*}_smollm2$SUFFIX" "${overrides[@]}" ;;
    *) echo "unknown job '$job' (peagle medusa eagle3 anneal curve_F rl rl_strong rl_greedy rl_t1 dspark dflash rnn," \
            "or NAME=FAMILY:k=v,k=v)"
       exit 2 ;;
  esac
done
