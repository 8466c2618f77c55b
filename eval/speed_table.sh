#!/usr/bin/env bash
# The README's speed rows ("Where a user waits") on one machine, one job at a time, in one run:
#   bash eval/speed_table.sh [OUT]        # ~40 min on 2 idle cores; OUT defaults to outputs/speed_table
# Each row is one eval/ benchmark (or the default training run); their last JSON lines go to $OUT/table.jsonl, one per
# row, with the command that made it. Re-running skips the rows already in it. Run nothing else meanwhile: a second
# heavy process on 2 cores changes every number (the "loaded" row adds its own competing process on purpose).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-outputs/speed_table}
THREADS=${THREADS:-2}
mkdir -p "$OUT"
TABLE="$OUT/table.jsonl"
touch "$TABLE"

row() {  # row NAME COMMAND...: run COMMAND unless NAME is in the table; append its last JSON line, tagged
  local name=$1; shift
  if grep -q "\"row\": \"$name\"" "$TABLE"; then echo "== $name: in $TABLE"; return; fi
  echo "== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  $PY - "$name" "$OUT/$name.log" "$*" >> "$TABLE" <<'EOF'
import json, sys
name, log, cmd = sys.argv[1:]
last = [l for l in open(log, errors="replace") if l.startswith("{")][-1]
print(json.dumps({"row": name, "command": cmd, **json.loads(last)}))
EOF
  tail -n 1 "$TABLE" | cut -c 1-400
}

DFL="$OUT/sharegpt.dfl"  # the draft file of make demo's step 2
[ -f "$DFL" ] || $PY -m data.draft_file build --out "$DFL" --threads "$THREADS" \
  --corpus "$($PY -c 'from data.readers import sharegpt_path; print(sharegpt_path())')" > "$OUT/dfl_build.log" 2>&1

speedup=($PY -m eval.speedup --prompts eval/data/spec_bench_dev.jsonl --categories mt_bench --limit 16 --max-new 128
         --check-lossless)
row plain_hf_bf16 "${speedup[@]}" --modes plain,spec,hf_generate --threads "$THREADS" --dtype bfloat16 \
  --source prompt_lookup
row plain_hf_fp32 "${speedup[@]}" --modes plain,spec,hf_generate --threads "$THREADS" --dtype float32 \
  --source prompt_lookup
row loaded_bf16 "${speedup[@]}" --modes plain,spec,hf_generate --threads 0 --load 1 --dtype bfloat16 \
  --source "draft_file:$DFL"
row regen "$PY" -m eval.regen_bench --threads "$THREADS"
row draft_file_build env RAYON_NUM_THREADS="$THREADS" "$PY" -m eval.draft_file_bench --out "$OUT/big.dfl" \
  --tokens 100e6 --threads "$THREADS"
rm -f "$OUT/big.dfl"

# training: the default experiment (its own regeneration and features first, cached under $OUT/data_cache); the row
# is the median of metrics.jsonl's logged windows (validation and checkpoints excluded) and the held-out estimates
if ! grep -q '"row": "train"' "$TABLE"; then
  train=($PY -m train.distill +experiment=peagle_smollm2 eval.limit=0 runtime.threads="$THREADS"
         data.cache_dir="$OUT/data_cache" output_dir="$OUT/train")
  echo "== train: ${train[*]}"
  /usr/bin/time -v "${train[@]}" > "$OUT/train.log" 2>&1
  $PY - "$OUT" "${train[*]}" >> "$TABLE" <<'EOF'
import json, re, statistics, sys
out, cmd = sys.argv[1:]
rows = [json.loads(l) for l in open(f"{out}/train/metrics.jsonl")]
tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
val = [r for r in rows if "val_tau_est" in r][-1]
log = open(f"{out}/train.log", errors="replace").read()
wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", log)
rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
print(json.dumps({"row": "train", "command": cmd,
                  "tokens_per_s_median": statistics.median(tps), "windows": len(tps),
                  "val_tau_est": val["val_tau_est"], "val_tau_chain": val.get("val_tau_chain"),
                  "wall": wall and wall.group(1), "peak_rss_gb": rss and round(int(rss.group(1)) / 2**20, 2)}))
EOF
  tail -n 1 "$TABLE"
fi
echo "== speed table: $TABLE (the line below: every row in one JSON object)"
$PY -c 'import json, sys; print(json.dumps({"bench": "speed_table", "rows": [json.loads(l) for l in open(sys.argv[1])]}))' \
  "$TABLE"
