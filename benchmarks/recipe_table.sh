#!/usr/bin/env bash
# The recipe table on a real target, with the project's own commands only (one H200, < 9 minutes):
#   1. prompts    benchmarks/recipe_prompts.py: ROWS varied prompt-only rows (topics x task kinds,
#                 math, code, two-turn conversations), shuffled
#   2. regenerate the target's own greedy replies (REPLY_TOKENS new tokens at most per turn)
#   3. prepare    chat template, loss masks; the last HELD_OUT usable conversations held out
#                 (their prompts never trained on)
#   4. bench precision --recipes RECIPES: the same drafter trained under each recipe for BUDGET_S
#                 seconds of training (equal GPU time), then tau on the held-out prompts (EVAL_TOKENS
#                 new tokens, greedy, lossless checked), loss curves and tau's spread per recipe
# Writes to $OUT (default ./recipe-out): recipe_table.txt (everything printed, with the time of
# each stage), recipe_table.json (every figure), regenerate/prepare logs.
#
#   TARGET=/tmp/smol-hf OUT=$OUT bash benchmarks/recipe_table.sh
#
# Time limits (s): TREGEN (150; the rows written by then are kept), TRECIPES (380): under 10 minutes in all.
# Knobs (env): TARGET (an HF model directory), DEVICE (cuda:0), MASK_TOKEN_ID (16: SmolLM2's
# unused <empty_output>; its tokenizer has no mask token and no spare embedding row), ROWS (2400),
# REPLY_TOKENS (256), REGEN_ROWS (256: regenerate's --max-batch-size, the rows its documented figures ran with), HELD_OUT (64), EVAL_TOKENS (128), BUDGET_S (25), ANCHORS (2048),
# RECIPES (paper,dpace,swa,muon,wsd,default), RECIPE_DEFS (extra --recipe definitions,
# space-separated NAME=KEY=VALUE,... items), WORK (/tmp/recipe-work: rebuilt every run).
set -uo pipefail
out="${OUT:-recipe-out}"; mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
py=${PY:-python3}
target=${TARGET:-/tmp/smol-hf}
device=${DEVICE:-cuda:0}
work=${WORK:-/tmp/recipe-work}
log="$out/recipe_table.txt"
# WORK is rebuilt: only a folder this script made (marked) or a new one is ever removed.
if [ -e "$work" ] && [ ! -f "$work/.recipe-table-work" ]; then
  echo "WORK=$work exists and is not this script's work folder: choose another WORK" | tee -a "$out/recipe_table.txt"; exit 2
fi
rm -rf "$work"; mkdir -p "$work"; touch "$work/.recipe-table-work"
: > "$log"
stage() { echo "== $1 ($(date -u +%T))" | tee -a "$log"; }
elapsed() { echo "   $1: $(( $(date +%s) - $2 )) s" | tee -a "$log"; }
[ -f "$target/config.json" ] || { echo "no model directory at TARGET=$target" | tee -a "$log"; exit 2; }
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$log" 2>&1
command -v nvidia-smi >/dev/null && nvidia-smi -L >> "$log"
t0=$(date +%s)

stage "prompts"; t=$(date +%s)
$py -m benchmarks.recipe_prompts "$work/prompts.jsonl" --rows "${ROWS:-2400}" >> "$log" 2>&1 || exit 1
elapsed prompts $t

stage "regenerate"; t=$(date +%s)
timeout "${TREGEN:-150}" $py -m dflash_ipc.cli regenerate --model "$target" --input "$work/prompts.jsonl" \
  --out "$work/replies.jsonl" --max-new-tokens "${REPLY_TOKENS:-256}" --max-batch-size "${REGEN_ROWS:-256}" --devices "$device" \
  > "$out/regenerate.log" 2>&1
rc=$?; tail -5 "$out/regenerate.log" >> "$log"; elapsed regenerate $t
if [ $rc -eq 124 ] && [ -s "$work/replies.jsonl" ]; then  # out of time: train on the rows written so far
  echo "regenerate stopped at TREGEN=${TREGEN:-150} s: $(wc -l < "$work/replies.jsonl") rows kept" | tee -a "$log"
elif [ $rc -ne 0 ]; then
  echo "regenerate failed (exit $rc): see regenerate.log" | tee -a "$log"; exit 1
fi

stage "prepare"; t=$(date +%s)
timeout 60 $py -m dflash_ipc.cli prepare --model "$target" --input "$work/replies.jsonl" --out "$work/data" \
  --max-length 1024 --held-out "${HELD_OUT:-64}" --workers 4 > "$out/prepare.log" 2>&1
rc=$?; tail -5 "$out/prepare.log" >> "$log"; elapsed prepare $t
[ $rc -eq 0 ] || { echo "prepare failed (exit $rc): see prepare.log" | tee -a "$log"; exit 1; }

stage "bench precision (recipes)"; t=$(date +%s)
defs=(); for d in ${RECIPE_DEFS:-}; do defs+=(--recipe "$d"); done
mask=(); [ -n "${MASK_TOKEN_ID-16}" ] && mask=(--mask-token-id "${MASK_TOKEN_ID-16}")  # MASK_TOKEN_ID= : derive it
timeout "${TRECIPES:-380}" $py -m dflash_ipc.cli bench precision --device "$device" --target "$target" \
  --data "$work/data" "${mask[@]}" \
  --recipes "${RECIPES:-paper,dpace,swa,muon,wsd,default}" "${defs[@]}" \
  --budget-s "${BUDGET_S:-25}" --anchors-per-step "${ANCHORS:-2048}" --num-layers "${NUM_LAYERS:-5}" \
  --eval-prompts "${HELD_OUT:-64}" --eval-tokens "${EVAL_TOKENS:-128}" --work-dir "$work/bench" \
  --json "$out/recipe_table.json" >> "$log" 2>&1
rc=$?; elapsed "bench precision" $t
echo "exit $rc; total $(( $(date +%s) - t0 )) s" | tee -a "$log"
exit $rc
