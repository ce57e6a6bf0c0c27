#!/usr/bin/env bash
# EAGLE-3 for SmolLM2-135M-Instruct on ten times the data of the EAGLE-2 drafters' last rounds
# (about 20M tokens against 1.9M), in one resumable run: the target's own greedy answers to every
# ShareGPT first turn that fits, to task prompts built from ShareGPT text (summaries,
# translations, passage questions, then code requests and extractions) and to later turns of
# the conversations, then one epoch of EAGLE-3's training with features computed as each
# sequence is drawn (no feature shards: they would take about 90 GB), in bfloat16 autocast where
# the CPU has fast bfloat16 matmuls, the three draft steps' losses weighted 1, 0.8, 0.64 as in
# EAGLE-3's own training. The run keeps itself as it stood after 1.9M and 5.7M tokens, the
# scaling table's smaller points.
#
# The answers are not in the repository (about 40k, 80 MB as tokens): they are greedy, so this
# regenerates them (hours on 2 cores: the batch engine answers about 900 tokens a second), and
# the archive directory keeps them for later runs. Rerun the same command after an interruption:
# answers are saved every two minutes and training resumes from its last checkpoint.
# Run from the repository root.
set -euo pipefail
OUT=${OUT:-runs/e3-smollm2-10x}
ANSWERS=${ANSWERS:-runs/answers-smollm2}
mkdir -p "$ANSWERS" && cp -n data/answers/smollm2/*.safetensors "$ANSWERS"/
vocabspec train --model smollm2 --drafter eagle3 --out "$OUT" --conversations 64 --distill-start 0 \
    --self-distill 9900 --task-prompts 18900 --later-turns 11000 --answers "$ANSWERS" --generate-answers \
    --online-features --train-dtype auto --ttt-decay 0.8 --epochs 1 --snapshot-tokens 1.9M,5.7M
python scripts/drafter_scaling.py --model smollm2 --out docs/bench/scaling-smollm2 --append \
    --point "EAGLE-3,1.9M,$OUT/checkpoint-eagle3-at-1.9M.pt" \
    --point "EAGLE-3,5.7M,$OUT/checkpoint-eagle3-at-5.7M.pt" \
    --point "EAGLE-3,20M,$OUT/drafter"
