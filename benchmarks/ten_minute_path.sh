#!/usr/bin/env bash
# Prompts to a trusted drafter on one GPU with the project's own commands, timed per stage:
#   1. regenerate  the target's greedy replies to benchmarks/recipe_prompts.py's prompt set
#                  (skipped when REPLIES names the replies of an earlier run of the same command:
#                  the figure of that run's regenerate stage is then the stage's time)
#   2. prepare     chat template, loss masks, the last HELD_OUT usable conversations held out
#   3. up          configs/1xh200.yaml: the whole job (dispatcher, TARGETS target workers, DRAFTERS drafter
#                  workers) on DEVICE,
#                  under RECIPE (a recipe_table.json's best tau when RECIPE_JSON is given, else
#                  the job defaults),
#                  for about TRAIN_S seconds of drafter steps: data.num_epochs is chosen from the dataset's
#                  planned steps per epoch and STEP_MS (the recipe's measured step time in RECIPE_JSON);
#                  without TRAIN_S, it is what is left of TOTAL_S (counted from the script's start)
#                  after the stages so far and RESERVE_S (up's start and finish, and eval)
#   4. eval        tau on the HELD_OUT held-out prompts, EVAL_TOKENS new tokens, greedy, --check-lossless
# Writes to $OUT (default ./path-out): ten_minute_path.txt (stages, their times, eval's report) and the logs.
#
#   TARGET=/tmp/smol-hf RECIPE_JSON=/tmp/recipe_table.json OUT=$OUT bash benchmarks/ten_minute_path.sh
#
# Knobs (env): TARGET, DEVICE (cuda:0), MASK_TOKEN_ID (16, as in recipe_table.sh), ROWS (6000),
# REPLY_TOKENS (256), REGEN_ROWS (256: regenerate's --max-batch-size, the rows its documented figure ran with), TREGEN (120), REPLIES, HELD_OUT (64), EVAL_TOKENS (128), TRAIN_S (unset),
# STEP_MS (95: the default recipe's step for a 135M-class target on an H200 in this job, docs/benchmarks.md), RECIPE (a name in RECIPE_JSON; without one, the job defaults), RECIPE_JSON, NUM_LAYERS (5), ANCHORS (2048),
# TARGETS (1), DRAFTERS (1), DTYPE (bfloat16), WORK (/tmp/path-work: rebuilt every run), TUP (480),
# TOTAL_S (545), RESERVE_S (125: up's start, features and last checkpoint 58-85 s, eval 35-42 s, measured).
set -uo pipefail
out="${OUT:-path-out}"; mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
py=${PY:-python3}
target=${TARGET:-/tmp/smol-hf}
device=${DEVICE:-cuda:0}
work=${WORK:-/tmp/path-work}
held_out=${HELD_OUT:-64}
log="$out/ten_minute_path.txt"
if [ -e "$work" ] && [ ! -f "$work/.ten-minute-path-work" ]; then
  echo "WORK=$work exists and is not this script's work folder: choose another WORK" | tee -a "$log"; exit 2
fi
rm -rf "$work"; mkdir -p "$work"; touch "$work/.ten-minute-path-work"
: > "$log"
stage() { echo "== $1 ($(date -u +%T))" | tee -a "$log"; }
elapsed() { echo "   $1: $(( $(date +%s) - $2 )) s" | tee -a "$log"; }
[ -f "$target/config.json" ] || { echo "no model directory at TARGET=$target" | tee -a "$log"; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi -L >> "$log"
t0=$(date +%s)

if [ -n "${REPLIES:-}" ]; then
  stage "regenerate: reused $REPLIES (the time of the run that wrote it is this stage's)"
  replies=$REPLIES
else
  stage "regenerate"; t=$(date +%s)
  $py -m benchmarks.recipe_prompts "$work/prompts.jsonl" --rows "${ROWS:-6000}" >> "$log" 2>&1 || exit 1
  replies=$work/replies.jsonl
  timeout "${TREGEN:-120}" $py -m dflash_ipc.cli regenerate --model "$target" --input "$work/prompts.jsonl" \
    --out "$replies" --max-new-tokens "${REPLY_TOKENS:-256}" --max-batch-size "${REGEN_ROWS:-256}" --devices "$device" > "$out/regenerate.log" 2>&1
  rc=$?; tail -2 "$out/regenerate.log" >> "$log"; elapsed regenerate $t
  if [ $rc -eq 124 ] && [ -s "$replies" ]; then
    echo "regenerate stopped at TREGEN=${TREGEN:-120} s: $(wc -l < "$replies") rows kept" | tee -a "$log"
  elif [ $rc -ne 0 ]; then
    echo "regenerate failed (exit $rc): see regenerate.log" | tee -a "$log"; exit 1
  fi
fi

stage "prepare"; t=$(date +%s)
timeout 90 $py -m dflash_ipc.cli prepare --model "$target" --input "$replies" --out "$work/data" \
  --max-length 1024 --held-out "$held_out" --workers 4 > "$out/prepare.log" 2>&1
rc=$?; tail -2 "$out/prepare.log" >> "$log"; elapsed prepare $t
[ $rc -eq 0 ] || { echo "prepare failed (exit $rc): see prepare.log" | tee -a "$log"; exit 1; }

stage "up"; t=$(date +%s)
if [ -n "${TRAIN_S:-}" ]; then
  train_s=$TRAIN_S
else  # fill the deadline: what the stages so far and the reserve leave of TOTAL_S
  train_s=$(( ${TOTAL_S:-545} - (t - t0) - ${RESERVE_S:-125} ))
  [ "$train_s" -ge 30 ] || { echo "TOTAL_S=${TOTAL_S:-545} leaves $train_s s of training: too little" | tee -a "$log"; exit 1; }
  echo "TOTAL_S=${TOTAL_S:-545}: $(( t - t0 )) s spent, RESERVE_S=${RESERVE_S:-125}: TRAIN_S=$train_s" | tee -a "$log"
fi
# The recipe's overrides and step time from the recipe table, and the epochs that fill TRAIN_S.
plan=$($py - "$work/data" "${RECIPE_JSON:-}" "${RECIPE:-}" "$train_s" "${STEP_MS:-95}" \
  "${ANCHORS:-2048}" "${DRAFTERS:-1}" <<'EOF'
import json, math, sys
from dflash_ipc.config.schema import ObjectiveConfig
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.drafter.trainer import estimate_total_steps
data, table, recipe, train_s, step_ms, anchors, drafters = sys.argv[1:]
overrides = []
if table:
    figures = json.load(open(table))
    taus = {name: t for name, t in figures["tau"].items() if name in figures["runs"]}
    recipe = recipe or max(taus, key=taus.get)
    run = figures["runs"][recipe]
    overrides = run["overrides"]
    step_ms = 1000 * sorted(run["step_s"])[len(run["step_s"]) // 2]
recipe = recipe or "default"
per_epoch = estimate_total_steps(TokenDataset(data), ObjectiveConfig(anchors_per_step=int(anchors)), num_epochs=1,
                                 world_size=int(drafters))
epochs = max(1, round(float(train_s) * 1000 / float(step_ms) / per_epoch))
print(recipe, epochs, per_epoch, f"{float(step_ms):.1f}", *overrides)
EOF
) || { echo "planning failed" | tee -a "$log"; exit 1; }
read -r recipe epochs per_epoch step_ms recipe_overrides <<< "$plan"
echo "recipe $recipe (${recipe_overrides:-no overrides}); $per_epoch steps an epoch at ~$step_ms ms a step:" \
  "$epochs epochs for TRAIN_S=$train_s s" | tee -a "$log"
overrides=(-o target.path="$target" -o data.path="$work/data" -o run.run_dir="$work/run"
  -o "target.devices=[$device]" -o "drafter.devices=[$device]" -o target.num_workers="${TARGETS:-1}"
  -o drafter.num_workers="${DRAFTERS:-1}" -o target.dtype="${DTYPE:-bfloat16}" -o drafter.dtype="${DTYPE:-bfloat16}"
  -o model.num_layers="${NUM_LAYERS:-5}" -o objective.anchors_per_step="${ANCHORS:-2048}" -o data.num_epochs="$epochs")
[ -n "${MASK_TOKEN_ID-16}" ] && overrides+=(-o model.mask_token_id="${MASK_TOKEN_ID-16}")
for o in $recipe_overrides; do overrides+=(-o "$o"); done
timeout "${TUP:-480}" $py -m dflash_ipc.cli up --config configs/1xh200.yaml "${overrides[@]}" > "$out/up.log" 2>&1
rc=$?; tail -4 "$out/up.log" >> "$log"; elapsed up $t
[ $rc -eq 0 ] || { echo "up failed (exit $rc): see up.log" | tee -a "$log"; exit 1; }

stage "eval"; t=$(date +%s)
timeout 150 $py -m dflash_ipc.cli eval --target "$target" --drafter "$work/run/checkpoints" --data "$work/data" \
  --num-prompts "$held_out" --max-new-tokens "${EVAL_TOKENS:-128}" --device "$device" --check-lossless \
  --save-to "$work/run" > "$out/eval.log" 2>&1
rc=$?; grep -v "^[0-9:]* [IWE] \[" "$out/eval.log" >> "$log"; elapsed eval $t
echo "exit $rc; total $(( $(date +%s) - t0 )) s" | tee -a "$log"
exit $rc
