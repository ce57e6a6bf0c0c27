#!/usr/bin/env bash
# EAGLE-3 for a bundled model (bash recipes/eagle3-10x.sh smollm2|gemma3) on ten times the data
# of SmolLM2's EAGLE-2 drafter's last rounds (about 20M tokens against 1.9M), in one resumable
# run: the target's own greedy answers to every ShareGPT first turn that fits, to task prompts
# (summaries, translations, passage questions, code requests and extractions built from ShareGPT
# text, then 2,000 arithmetic word problems) and to later turns of the conversations; then one
# epoch of EAGLE-3's training with features computed as each sequence is drawn (no feature
# shards: they would take about 90 GB) by the engine a user decodes with (the states drafting
# reads; on these CPUs the native engine, 1.7x torch's bfloat16 prefill), in bfloat16 autocast
# where the CPU has fast bfloat16 matmuls, the three draft steps' losses weighted 1, 0.8, 0.64
# as in EAGLE-3's own training.
# The run keeps itself as it stood after 1.9M and 5.7M tokens, the scaling table's smaller points.
#
# The answers are not in the repository (about 40k per model, 80 MB as tokens): they are greedy, so this
# regenerates them (hours on 2 cores: the batch engine answers about 900 tokens a second), and
# the archive directory keeps them for later runs. Rerun the same command after an interruption:
# answers are saved every two minutes and training resumes from its last checkpoint.
# Run from the repository root.
set -euo pipefail
MODEL=${1:?usage: recipes/eagle3-10x.sh smollm2|gemma3}
OUT=${OUT:-runs/e3-$MODEL-10x}
ANSWERS=${ANSWERS:-runs/answers-$MODEL}
DEVICE=${DEVICE:-cpu}      # cuda: features and training on a GPU (answers too, requests in turn)
case $MODEL in     # every prompt of each kind that fits the room its answers leave, 2,000 problems
  smollm2) DATA="--conversations 64 --self-distill 9900 --task-prompts 20954 --later-turns 11000" ;;
  gemma3) DATA="--conversations 100 --self-distill 10000 --task-prompts 21174 --later-turns 13000 --distill-new-tokens 128" ;;
  *) echo "unknown model $MODEL" >&2; exit 2 ;;
esac
mkdir -p "$ANSWERS" && cp -n data/answers/$MODEL/*.safetensors "$ANSWERS"/
vocabspec train --model $MODEL --drafter eagle3 --out "$OUT" --distill-start 0 $DATA \
    --answers "$ANSWERS" --generate-answers --online-features --feature-dtype runtime \
    --train-dtype auto --ttt-decay 0.8 --device "$DEVICE" --epochs 1 --snapshot-tokens 1.9M,5.7M
python scripts/drafter_scaling.py --model $MODEL --out docs/bench/scaling-$MODEL --append \
    --point "EAGLE-3,1.9M,$OUT/checkpoint-eagle3-at-1.9M.pt" \
    --point "EAGLE-3,5.7M,$OUT/checkpoint-eagle3-at-5.7M.pt" \
    --point "EAGLE-3,20M,$OUT/drafter"
