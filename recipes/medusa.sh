#!/usr/bin/env bash
# The shipped Medusa heads (vocabspec/drafters/MODEL/medusa): four heads trained on the
# target's features over its own answers from the answer archive its drafter's recipe builds
# (the first 640 sequences, as they are; the archive they were trained from is in git history:
# git show a0623c9:data/answers) and a few ShareGPT conversations. Minutes per model on a 2-core CPU
# (feature extraction most of it); run from the repository root.
set -euo pipefail
vocabspec train --model smollm2 --drafter medusa --conversations 32 --archive-sequences 640 \
    --answers runs/answers-smollm2 --out runs/medusa-smollm2 --epochs 4 --lr 2e-3 --ship
vocabspec train --model gemma3 --drafter medusa --conversations 32 --archive-sequences 640 \
    --distill-new-tokens 128 --answers runs/answers-gemma3 --out runs/medusa-gemma3 --epochs 4 \
    --lr 2e-3 --ship
