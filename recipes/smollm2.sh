#!/usr/bin/env bash
# SmolLM2-135M-Instruct's EAGLE-2 drafter (vocabspec/drafters/smollm2), round by round:
# ShareGPT conversations, then the target's own answers (self-distillation) kept in an answer
# archive (runs/answers-smollm2: generated once, reused by every round after; the archive these
# rounds read is in git history: git show a0623c9:data/answers/smollm2), and the SpecVocab ranker
# after the drafter. Every round fine-tunes the one before.
# Takes about a day on a 2-core CPU; run from the repository root. Each `--ship` copies the
# drafter (bfloat16) into the package, so later rounds start from it.
# Every round that lacks answers generates them (--generate-answers; greedy, so the same ones).
set -euo pipefail
A="--answers runs/answers-smollm2 --generate-answers"
# Round 1: ShareGPT only. Rounds 2-3: plus the target's answers, a 2-step unrolled loss.
vocabspec train --model smollm2 --conversations 800 --epochs 3 $A --ship
vocabspec train --model smollm2 --conversations 800 --self-distill 384 --unroll 2 \
    --init vocabspec/drafters/smollm2 --epochs 1 --lr 5e-4 $A --generate-answers --ship
vocabspec train --model smollm2 --conversations 800 --self-distill 1152 --task-prompts 320 \
    --unroll 2 --init vocabspec/drafters/smollm2 --epochs 1 --lr 4e-4 $A --generate-answers --ship
# Round 4: six times the conversations, the same answers; the ranker.
vocabspec train --model smollm2 --conversations 2400 --distill-start 400 --self-distill 320 \
    --task-prompts 96 --unroll 2 --init vocabspec/drafters/smollm2 --epochs 1 --lr 4e-4 $A --generate-answers --ship
vocabspec ranker --model smollm2 --sequences 800 --positions 128
# Round 5: 4.7 times the answers, two epochs at falling rates, the ranker fine-tuned after each.
for lr in 4e-4 2e-4; do
  vocabspec train --model smollm2 --conversations 400 --distill-start 400 --self-distill 2120 \
      --task-prompts 96 --unroll 2 --init vocabspec/drafters/smollm2 --epochs 1 --lr $lr $A --generate-answers --ship
  vocabspec ranker --model smollm2 --sequences 800 --positions 128 \
      --init vocabspec/drafters/smollm2/ranker.safetensors
done
# Round 6: twice the answers.
vocabspec train --model smollm2 --conversations 400 --distill-start 400 --self-distill 4520 \
    --task-prompts 96 --unroll 2 --init vocabspec/drafters/smollm2 --epochs 1 --lr 3e-4 $A --generate-answers --ship
vocabspec ranker --model smollm2 --sequences 800 --positions 128 \
    --init vocabspec/drafters/smollm2/ranker.safetensors
# Rounds 7-12: answers to prompts after the first 5,449 conversations.
W="--out runs/train-smollm2-late --conversations 64 --distill-start 5449 --unroll 2"
vocabspec train --model smollm2 $W --self-distill 750 --init vocabspec/drafters/smollm2 --epochs 1 --lr 2e-4 $A --ship
vocabspec train --model smollm2 $W --self-distill 2100 --init vocabspec/drafters/smollm2 --epochs 1 --lr 2e-4 $A --ship
vocabspec ranker --model smollm2 --features runs/train-smollm2-late --sequences 800 --positions 128 \
    --init vocabspec/drafters/smollm2/ranker.safetensors
vocabspec train --model smollm2 $W --self-distill 2100 --init vocabspec/drafters/smollm2 --epochs 1 --lr 1.5e-4 $A --ship
vocabspec train --model smollm2 $W --self-distill 2100 --init vocabspec/drafters/smollm2 --epochs 1 --lr 1e-4 $A --ship
vocabspec train --model smollm2 $W --self-distill 3900 --init vocabspec/drafters/smollm2 --epochs 1 --lr 1.5e-4 $A --ship
vocabspec ranker --model smollm2 --features runs/train-smollm2-late --sequences 800 --positions 128 \
    --init vocabspec/drafters/smollm2/ranker.safetensors
for lr in 1.2e-4 8e-5; do     # rounds 11 and 12 (the shipped one): all 5,284 archived answers
  vocabspec train --model smollm2 $W --self-distill 5043 --task-prompts 400 \
      --init vocabspec/drafters/smollm2 --epochs 1 --lr $lr $A --ship
  vocabspec ranker --model smollm2 --features runs/train-smollm2-late --sequences 800 --positions 128 \
      --init vocabspec/drafters/smollm2/ranker.safetensors
done
# Draft vocabularies beside it: FR-Spec (corpus), VocabTrim (the target's own tokens), successors.
vocabspec vocab --model smollm2 --source sharegpt --out vocabspec/drafters/smollm2/token_map_fr.pt
vocabspec vocab --model smollm2 --source target --features runs/train-smollm2-late/features \
    --out vocabspec/drafters/smollm2/token_map_trim.pt
vocabspec vocab --model smollm2 --successors 32 --out vocabspec/drafters/smollm2/successors.safetensors
