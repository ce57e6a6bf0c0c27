"""SpecVocab recall on Spec-Bench: how often the target's next token (and the drafter's own
top-1) is among SpecVocab's k candidates, at every position the target generated. Two sets:
the candidates SpecVocab drafts from (`spec:K`: the ranker's best plus the text's own tokens,
half of K at most, and the usual successors of the token just read), and the ranker's top k
alone (`spec:K,context=0,successors=0`, the paper's rule for one row). For scale, the
same recall for the drafter's exact full-vocabulary head: the most any ranker of the drafter's
state alone could reach. The drafter computes in its default dtype (`--draft-dtype
auto`: bfloat16 on CPUs with fast bfloat16 matmuls), as `vocabspec generate` drafts.

For each question (first turn), vanilla greedy decoding writes the answer; one target forward
over prompt + answer gives the features the drafter sees when it drafts the first token of a
step, and the target's choice at each answer position.

    python scripts/ranker_recall_specbench.py --model gemma3 --per-category 2 --new-tokens 128

With --answers, the answers come from a benchmark run's answers.jsonl (its vanilla method's
first turns) instead of being generated again.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import json

import torch
from tqdm import tqdm

import vocabspec
from vocabspec.speculation.config import bundled_drafter_dir
from vocabspec.speculation.vocab.draft_vocab import make_draft_vocab
from vocabspec.benchmarks.bench import load_questions
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.runtime.linear import linear
from vocabspec.runtime.prompts import encode_conversation
from vocabspec.training.ranker import hits_in_top
from vocabspec.speculation.families.eagle import draft_states, features_of

QUESTIONS = "../shared/data/spec_bench/question.jsonl"   # Spec-Bench's, beside the repository
QUESTIONS = QUESTIONS if Path(QUESTIONS).exists() else "builtin"   # else the project's own prompts


def _vanilla_answers(path: str, questions: list[dict]) -> dict:
    """question_id -> vanilla's first-turn token ids, for every question asked."""
    answers = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("method") == "vanilla":
                answers[record["question_id"]] = record["choices"][0]["token_ids"][0]
    missing = [q["question_id"] for q in questions if q["question_id"] not in answers]
    if missing:
        raise SystemExit(f"{path} has no vanilla answer for questions {missing}")
    return answers


def _candidate_hits(strategy, states, tokens: list[int], first: int, wanted, drafted):
    """(target's next token, drafter's top-1) counts found in SpecVocab's candidate set, built
    position by position as drafting builds it: states[i], read from token first + i + 1,
    drafts token first + i + 2, when the text holds tokens[:first + i + 2]."""
    strategy.see_tokens(tokens[:first + 2], reset=True)
    found_target = found_drafted = 0
    for i in range(states.shape[0]):
        ids = strategy.candidate_ids(states[i:i + 1], [tokens[first + i + 1]])
        found_target += int((ids == wanted[i]).any())
        found_drafted += int((ids == drafted[i]).any())
        strategy.see_tokens([tokens[first + i + 2]])
    return found_target, found_drafted


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="bundled model name")
    parser.add_argument("--questions", default=QUESTIONS, help="Spec-Bench question.jsonl")
    parser.add_argument("--per-category", type=int, default=1, help="questions per category")
    parser.add_argument("--new-tokens", type=int, default=128, help="answer tokens per question")
    parser.add_argument("--k", default="512,1024,2048,4096", help="candidate counts to score")
    parser.add_argument("--ranker", help="ranker file (default: the bundled one)")
    parser.add_argument("--draft-path", help="drafter directory (default: the bundled EAGLE-2 drafter, "
                                             "whose states the bundled ranker was trained on)")
    parser.add_argument("--context", type=int, default=None,
                        help="the text's tokens among the candidates (spec:K,context=C; default K/2)")
    parser.add_argument("--successors", type=int, default=None,
                        help="successors of the token just read among the candidates (spec:K,successors=S; "
                             "default: 16 where the drafter has a successor table)")
    parser.add_argument("--answers", help="a `vocabspec bench` answers.jsonl to take vanilla's "
                                           "answers from (then --new-tokens is unused)")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    # torch's kernels: the ranker is read as training reads it (train.draft_states).
    # (It measures recall, not speculative output: torch's inexact verification is allowed.)
    lm = vocabspec.load(args.model, draft="eagle", path=args.draft_path or "eagle2", vocab="full", total_tokens=8,
                        backend="torch", allow_inexact=True)
    target, drafter = lm.engine.model, lm.engine.proposer.drafter
    full_head = lm.engine.proposer.draft_vocab.weight      # in the drafter's dtype, as it drafts
    files = bundled_drafter_dir(args.model)
    ranker = make_draft_vocab("spec:2048", target.head_weight, files, ranker=args.ranker)
    def options(k: int) -> str:
        """',context=C,successors=S' of spec:K (empty: the defaults). C is capped at each K (not
        at the smallest K): spec:K refuses C > K."""
        named = "" if args.context is None else f",context={min(args.context, k)}"
        return named + ("" if args.successors is None else f",successors={args.successors}")

    strategies = {k: make_draft_vocab(f"spec:{k}{options(k)}", target.head_weight, files,
                                      ranker=args.ranker) for k in ks}
    questions = load_questions(args.questions, args.per_category)
    answers = _vanilla_answers(args.answers, questions) if args.answers else {}
    hits = {k: [0, 0, 0, 0, 0] for k in ks}
    positions = 0
    with torch.inference_mode():
        for q in tqdm(questions, desc="recall", unit="question"):
            ids = encode_conversation(lm.tokenizer, [("user", q["turns"][0])], answer_open=True)
            if answers:
                answer = answers[q["question_id"]]
            else:
                answer = lm.engine.generate(ids, GenerationConfig(max_new_tokens=args.new_tokens)).tokens
            tokens = torch.tensor(ids + answer)
            cache = target.new_cache(len(tokens) + 1)
            hidden, _ = target.tree_forward(tokens, torch.arange(len(tokens)), cache)
            logits = target.lm_head(hidden)
            states = draft_states(drafter, tokens, features_of(target, hidden))
            # states[i] drafts token i + 2, which the target chose from logits[i + 1]. Drafting
            # starts at the second answer token (the first comes from the prefill).
            first, count = len(ids) - 1, len(answer) - 1
            states = states[first:first + count]
            wanted = logits[first + 1:first + 1 + count].argmax(-1)
            exact = linear(states.to(full_head.dtype), full_head).float()
            drafted = exact.argmax(-1)
            scores = ranker.scores(states)      # exactly what SpecVocab ranks by when drafting
            for k, found in hits_in_top(scores, wanted, ks).items():
                hits[k][0] += found
            for k, found in hits_in_top(scores, drafted, ks).items():
                hits[k][1] += found
            for k, found in hits_in_top(exact, wanted, ks).items():
                hits[k][2] += found
            for k, strategy in strategies.items():
                found = _candidate_hits(strategy, states, tokens.tolist(), first, wanted, drafted)
                hits[k][3] += found[0]
                hits[k][4] += found[1]
            positions += count
    result = {"model": args.model, "ranker": args.ranker or "bundled",
              "drafter": args.draft_path or "bundled", "context": args.context,
              "successors": strategies[ks[0]].successor_count,
              "questions": len(questions), "positions": positions,
              "candidates_recall_target": {k: round(h[3] / positions, 4) for k, h in hits.items()},
              "candidates_recall_drafter_top1": {k: round(h[4] / positions, 4) for k, h in hits.items()},
              "recall_target": {k: round(h[0] / positions, 4) for k, h in hits.items()},
              "recall_drafter_top1": {k: round(h[1] / positions, 4) for k, h in hits.items()},
              "full_head_recall_target": {k: round(h[2] / positions, 4) for k, h in hits.items()}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
