#!/usr/bin/env bash
# The shipped Medusa heads (vocabspec/drafters/MODEL/medusa): four heads trained on the
# target's features over its own answers from the repository's answer archive (the first 640
# sequences, as they are) and a few ShareGPT conversations. Minutes per model on a 2-core CPU
# (feature extraction most of it); run from the repository root.
set -euo pipefail
vocabspec train --model smollm2 --drafter medusa --conversations 32 --archive-sequences 640 \
    --answers data/answers/smollm2 --out runs/medusa-smollm2 --epochs 4 --lr 2e-3 --ship
vocabspec train --model gemma3 --drafter medusa --conversations 32 --archive-sequences 640 \
    --distill-new-tokens 128 --answers data/answers/gemma3 --out runs/medusa-gemma3 --epochs 4 \
    --lr 2e-3 --ship
