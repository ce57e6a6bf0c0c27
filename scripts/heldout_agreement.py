"""Teacher-forced top-1 agreement of an EAGLE-3 drafter with its target on a benchmark run's own
greedy answers: how often draft step 1 names the target's next token, counted over the answers'
rows alone and over every row (prompt included, as training's held-out agreement counts).

    python scripts/heldout_agreement.py --answers runs/bench-smollm2/answers.jsonl \
        --questions vocabspec/data/heldout.jsonl [--draft-path DIR]

Set beside a 1/1 tree's acceptance on the same answers (`vocabspec bench`), it says whether
drafting loses what teacher forcing finds (a mismatch of features or paths) or the prompts are
just harder than the training data's.
"""

from __future__ import annotations

import argparse
import json

import torch

from vocabspec.runtime.loading import load_model
from vocabspec.runtime.prompts import encode_conversation
from vocabspec.runtime.tokenizer import load_tokenizer
from vocabspec.speculation.families.eagle3 import Eagle3Drafter
from vocabspec.speculation.config import bundled_eagle3_dir
from vocabspec.training.eagle3_train import target_features
from vocabspec.training.eagle3_train import StepAttention, StepKeys


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--answers", required=True, help="a bench run's answers.jsonl")
    parser.add_argument("--questions", required=True, help="the question file it answered")
    parser.add_argument("--draft-path", default=None, help="EAGLE-3 drafter (default: the model's shipped one)")
    parser.add_argument("--method", default="vanilla", help="whose answers to read (default vanilla)")
    args = parser.parse_args()
    target, path = load_model(args.model, weights="f32", backend="torch", max_seq_len=4096)
    tokenizer = load_tokenizer(path)
    drafter = Eagle3Drafter.load(args.draft_path or bundled_eagle3_dir(args.model), target, dtype=torch.float32)
    questions = {q["question_id"]: q for q in map(json.loads, open(args.questions))}
    counts = {"answer": [0, 0], "every": [0, 0]}
    for answer in map(json.loads, open(args.answers)):
        if answer["method"] != args.method:
            continue
        prompt = encode_conversation(tokenizer, [("user", questions[answer["question_id"]]["turns"][0])],
                                     answer_open=True)
        sequence = prompt + answer["choices"][0]["token_ids"][0]
        features = target_features(target, [sequence], drafter.taps)
        n = len(sequence) - 2           # row i reads token i + 1 and names token i + 2
        rows = drafter.input_rows(torch.cat([features["tapped"], features["hidden"]], -1)[0, :n])
        states = drafter(features["tokens"][0, 1:1 + n], rows, torch.arange(n), StepKeys(),
                         tree_mask=StepAttention(0))
        guess = drafter.draft_ids[drafter.lm_head(drafter.head_input(states)).argmax(-1)]
        right = guess == features["chosen"][0, 1:1 + n]
        first_answer_row = len(prompt) - 2
        counts["answer"][0] += int(right[first_answer_row:].sum())
        counts["answer"][1] += n - first_answer_row
        counts["every"][0] += int(right.sum())
        counts["every"][1] += n
    print(json.dumps({f"{k}_rows": {"agreement": round(h / max(t, 1), 4), "rows": t}
                      for k, (h, t) in counts.items()}))


if __name__ == "__main__":
    main()
