#!/usr/bin/env bash
# EAGLE-3 for a bundled model (bash recipes/eagle3-10x.sh smollm2|gemma3) on ten times the data
# of SmolLM2's EAGLE-2 drafter's last rounds (about 21M tokens against 1.9M): the target's own
# greedy answers to every ShareGPT first turn that fits, to task prompts (summaries,
# translations, passage questions, code requests and extractions built from ShareGPT text, then
# 2,000 arithmetic word problems) and to later turns of the conversations; then one epoch of
# EAGLE-3's training, the three draft steps' losses weighted 1, 0.8, 0.64 as in EAGLE-3's own.
#
# DEVICE=cuda (a GPU; an H200 takes about 6 minutes from the GGUF): answers, features and
# training batched on the device (training/eagle3_device.py), hard labels (the target's choice:
# they beat its distribution at 20.9M tokens). The prompts are tokenized first where the
# ShareGPT package is (PROMPTS= a file made earlier skips that, as on a machine without it).
# INIT=DIR continues a drafter (the shipped one: vocabspec/drafters/MODEL/eagle3) on the answers
# in ANSWERS (answers-K.npz from an earlier run) instead of starting afresh. SELF_PROMPTS=N
# (SELF_START=S) adds up to N prompts the target writes itself, seeds from S on, drawn and
# answered on the device: fresh data once ShareGPT's is used.
#
# DEVICE=cpu: the same recipe through `vocabspec train` on the engine a user decodes with (hours
# on 2 cores: the batch engine answers about 900 tokens a second), resumable: rerun the same
# command after an interruption; the archive directory keeps the answers for later runs.
# Run from the repository root.
set -euo pipefail
MODEL=${1:?usage: recipes/eagle3-10x.sh smollm2|gemma3}
OUT=${OUT:-runs/e3-$MODEL-10x}
ANSWERS=${ANSWERS:-runs/answers-$MODEL}
DEVICE=${DEVICE:-cpu}
if [ "$DEVICE" != cpu ]; then
  PROMPTS=${PROMPTS:-$OUT/prompts-$MODEL.npz}
  mkdir -p "$OUT"
  [ -f "$PROMPTS" ] || python -m vocabspec.training.eagle3_device export --model "$MODEL" --out "$PROMPTS"
  EXTRA=()
  [ -n "${INIT:-}" ] && EXTRA+=(--init "$INIT" --answers "$ANSWERS" --lr 1e-3)
  [ -n "${SELF_PROMPTS:-}" ] && EXTRA+=(--self-prompts "$SELF_PROMPTS" --self-prompts-start "${SELF_START:-0}")
  python -m vocabspec.training.eagle3_device run --model "${GGUF:-$MODEL}" --recipe-model "$MODEL" \
      --prompts "$PROMPTS" --out "$OUT" --device "$DEVICE" --labels hard --budget-s "${BUDGET_S:-540}" \
      "${EXTRA[@]}"
  echo "drafter: $OUT/drafter-hard; measure it here or on a CPU with scripts/drafter_scaling.py"
  exit 0
fi
case $MODEL in     # every prompt of each kind that fits the room its answers leave, 2,000 problems
  smollm2) DATA="--conversations 64 --self-distill 9900 --task-prompts 20954 --later-turns 11000" ;;
  gemma3) DATA="--conversations 100 --self-distill 10000 --task-prompts 21174 --later-turns 13000 --distill-new-tokens 128" ;;
  *) echo "unknown model $MODEL" >&2; exit 2 ;;
esac
mkdir -p "$ANSWERS"
vocabspec train --model $MODEL --drafter eagle3 --out "$OUT" --distill-start 0 $DATA \
    --answers "$ANSWERS" --generate-answers --online-features --feature-dtype runtime \
    --train-dtype auto --ttt-decay 0.8 --device cpu --epochs 1 --snapshot-tokens 1.9M,5.7M
python scripts/drafter_scaling.py --model $MODEL --out docs/bench/scaling-$MODEL --append \
    --point "EAGLE-3,1.9M,$OUT/checkpoint-eagle3-at-1.9M.pt" \
    --point "EAGLE-3,5.7M,$OUT/checkpoint-eagle3-at-5.7M.pt" \
    --point "EAGLE-3,20M,$OUT/drafter"
