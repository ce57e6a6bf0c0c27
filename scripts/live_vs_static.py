"""The live tree-size rule against fixed trees and plain decoding, per category, in one process.

The 13 Spec-Bench first turns (one a category) and the held-out prompts
(`vocabspec/data/heldout.jsonl`), 128 greedy tokens each, every method on every prompt in turn,
`--rounds` times over (on a shared 2-core VM one generation's speed swings 10-20%: the rounds
and the interleaving spread that over every method alike). tok/s is the whole generation's,
prefill included, as `vocabspec bench` counts it; tau is tokens a step.

    python scripts/live_vs_static.py --model smollm2 --methods plain,eagle@3x3,eagle --rounds 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
HELDOUT = ROOT / "vocabspec" / "data" / "heldout.jsonl"


def prompts() -> list[tuple[str, str]]:
    """(category, prompt): Spec-Bench's first question of each category, then the held-out."""
    first = {}
    for line in QUESTIONS.read_text().splitlines():
        question = json.loads(line)
        first.setdefault(question["category"], question["turns"][0])
    heldout = [json.loads(line)["turns"][0] for line in HELDOUT.read_text().splitlines()]
    return list(first.items()) + [(f"heldout-{i}", text) for i, text in enumerate(heldout)]


def proposer(target, tokenizer, model: str, method: str):
    """plain, or a --draft method with @DEPTHxTOKENS fixing its tree (else the live rule)."""
    from vocabspec.speculation.config import DraftConfig
    from vocabspec.tuning.proposers import make_proposer

    if method == "plain":
        return None
    name, _, tree = method.partition("@")
    fixed = {}
    if tree:
        depth, total = tree.split("x")
        fixed = {"depth": int(depth), "total_tokens": int(total)}
    return make_proposer(target, DraftConfig.from_method(name, **fixed), model, tokenizer=tokenizer)


def main() -> None:
    from vocabspec.runtime.loading import load_model
    from vocabspec.runtime.prompts import encode_conversation
    from vocabspec.runtime.tokenizer import load_tokenizer
    from vocabspec.decoding.batch import Engine
    from vocabspec.decoding.generate import GenerationConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--methods", default="plain,eagle")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the table")
    args = parser.parse_args()
    methods = args.methods.split(",")
    target, path = load_model(args.model)
    tokenizer = load_tokenizer(path)
    engines = {m: Engine(target, tokenizer, proposer(target, tokenizer, args.model, m)) for m in methods}
    config = GenerationConfig(max_new_tokens=128)
    totals: dict[str, dict[str, list[float]]] = {}      # category -> method -> [tokens, s, steps]
    items = prompts()
    for round_ in range(args.rounds):
        for category, text in items:
            ids = encode_conversation(tokenizer, [("user", text)], answer_open=True)
            for method, engine in engines.items():
                result = engine.generate(ids, config)
                row = totals.setdefault(category, {}).setdefault(method, [0, 0.0, 0])
                row[0] += result.new_tokens
                row[1] += result.seconds
                row[2] += len(result.steps)
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    groups = {c: [c] for c in totals}
    groups["spec-bench"] = [c for c in totals if not c.startswith("heldout")]
    groups["heldout"] = [c for c in totals if c.startswith("heldout")]
    table = {}
    for group, members in groups.items():
        sums = {m: [sum(totals[c][m][i] for c in members) for i in range(3)] for m in methods}
        rate = {m: sums[m][0] / sums[m][1] for m in methods}
        table[group] = {m: {"tok_s": round(rate[m], 1), "x_first": round(rate[m] / rate[methods[0]], 3),
                            "tau": round(sums[m][0] / sums[m][2], 2)} for m in methods}
        print(f"{group:16}" + "  ".join(f"{m}: {r['tok_s']:6.1f} ({r['x_first']:.3f}x, tau {r['tau']:.2f})"
                                        for m, r in table[group].items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "rounds": args.rounds, "table": table}, indent=1))


if __name__ == "__main__":
    main()
