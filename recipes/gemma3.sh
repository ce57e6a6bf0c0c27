#!/usr/bin/env bash
# The shipped Gemma 3 270M drafter (vocabspec/drafters/gemma3), round by round: ShareGPT
# conversations in the Question/Answer frame, then the base model's own answers
# (self-distillation, answers cut at 128 tokens) kept in an answer archive
# (runs/answers-gemma3), and the SpecVocab ranker. Every round fine-tunes the one before.
# Takes about 12 hours on a 2-core CPU; run from the repository root.
# Every round that lacks answers generates them (--generate-answers; greedy, so the same ones;
# the archive these rounds read is in git history: git show a0623c9:data/answers/gemma3).
set -euo pipefail
A="--answers runs/answers-gemma3 --generate-answers --distill-new-tokens 128"
vocabspec train --model gemma3 --conversations 600 --epochs 2 --ship
vocabspec train --model gemma3 --conversations 600 --self-distill 320 --unroll 2 \
    --init vocabspec/drafters/gemma3 --epochs 1 --lr 5e-4 $A --generate-answers --ship
vocabspec train --model gemma3 --conversations 600 --self-distill 960 --unroll 2 \
    --init vocabspec/drafters/gemma3 --epochs 1 --lr 5e-4 $A --generate-answers --ship
vocabspec train --model gemma3 --conversations 600 --self-distill 960 --task-prompts 320 --unroll 2 \
    --init vocabspec/drafters/gemma3 --epochs 1 --lr 4e-4 $A --generate-answers --ship
vocabspec ranker --model gemma3 --sequences 240 --positions 128
# Rounds 5 and 6 (the shipped one): prompts after the 960 ShareGPT ones rounds 2-4 answered.
vocabspec train --model gemma3 --conversations 100 --self-distill 480 --distill-start 1662 \
    --task-prompts 560 --unroll 2 --init vocabspec/drafters/gemma3 --epochs 1 --lr 3e-4 $A --ship
vocabspec train --model gemma3 --conversations 100 --self-distill 1280 --distill-start 1662 \
    --task-prompts 560 --unroll 2 --init vocabspec/drafters/gemma3 --epochs 1 --lr 2e-4 $A --ship
vocabspec vocab --model gemma3 --source sharegpt --size 65536 --out vocabspec/drafters/gemma3/token_map_fr.pt
vocabspec vocab --model gemma3 --source target --out vocabspec/drafters/gemma3/token_map_trim.pt
vocabspec vocab --model gemma3 --successors 32 --out vocabspec/drafters/gemma3/successors.safetensors
