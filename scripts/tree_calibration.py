"""Does the drafter's confidence predict acceptance, and would another node value keep more
accepted tokens in EAGLE-2's tree?

Runs greedy EAGLE-2 generation (full head, a fixed depth/size tree) on Spec-Bench first turns
and records every node the drafter drafted at each step, with its conditional log-probability
and depth. Greedy output is the target's own, so a node is correct when its path spells the
tokens the target produced after that step's root. From this:

1. calibration: per depth, mean draft confidence against the rate at which a node is correct
   given that its parent is;
2. replay: each step's drafted nodes reranked under a node-value rule, the best `total` kept,
   accept length = 1 + depth of the deepest correct kept node. The rule "product of
   confidences" must reproduce the run's own tau (checked), which validates the replay; the
   other rules keep the drafted set fixed (a different value would also change which nodes are
   expanded, so their numbers are an estimate).

    python scripts/tree_calibration.py --model smollm2 --per-category 1 --out runs/calibration.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import vocabspec.speculation.families.eagle as drafter_module
from vocabspec.serving.api import load
from vocabspec.benchmarks.bench import BUILTIN_QUESTIONS, load_questions
from vocabspec.runtime.prompts import encode_conversation
from vocabspec.speculation.tree import TreeBuilder

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
SPEC_BENCH = SPEC_BENCH if SPEC_BENCH.exists() else BUILTIN_QUESTIONS   # the project's own prompts


class RecordingBuilder(TreeBuilder):
    built: list["RecordingBuilder"] = []

    def build(self, device=None):
        RecordingBuilder.built.append(self)
        return super().build(device)


def record_steps(args) -> list[dict]:
    drafter_module.TreeBuilder = RecordingBuilder
    lm = load(args.model, draft="eagle", path=args.draft_path, depth=args.depth,
              total_tokens=args.total)
    # The reference growth from Python (the native one drafts the same tree node for node): its
    # builder keeps every drafted node's value for the replay.
    lm.engine.proposer.drafting = drafter_module.TorchEagleDrafting(lm.engine.proposer)
    steps = []
    questions = load_questions(args.questions, args.per_category)[:args.limit or None]
    for number, question in enumerate(questions):
        ids = encode_conversation(lm.tokenizer, [("user", question["turns"][0])], answer_open=True)
        RecordingBuilder.built = []
        result = lm.engine.generate(ids, lm._config(max_new_tokens=args.max_new_tokens))
        output = result.tokens
        position = 0                                 # index of each step's root in the output
        for step, builder in zip(result.steps, RecordingBuilder.built):
            after = output[position + 1: position + 1 + args.depth + 1]
            steps.append({"category": question["category"], "accept_length": step.accept_length,
                          "continuation": after, "complete": len(after) == args.depth + 1,
                          "token": builder.token, "parent": builder.parent, "depth": builder.depth,
                          "value": builder.value})
            position += step.accept_length
        print(f"[{number + 1}/{len(questions)}] {question['category']}: tau {result.mean_accept_len:.3f}",
              file=sys.stderr)
    return steps


def correct_nodes(step: dict) -> set[int]:
    """Nodes whose path from the root spells the target's continuation."""
    good = {0}
    for node in range(1, len(step["token"])):
        parent, depth = step["parent"][node], step["depth"][node]
        if parent in good and depth <= len(step["continuation"]) \
                and step["token"][node] == step["continuation"][depth - 1]:
            good.add(node)
    return good


def node_log_probs(step: dict) -> list[float]:
    return [0.0] + [step["value"][n] - step["value"][step["parent"][n]] for n in range(1, len(step["token"]))]


def replay(step: dict, score, total: int) -> int:
    """Accept length if the drafted nodes were ranked by the summed `score(log_prob, depth)`."""
    log_probs = node_log_probs(step)
    value = [0.0] * len(log_probs)
    for node in range(1, len(log_probs)):
        value[node] = value[step["parent"][node]] + score(log_probs[node], step["depth"][node])
    ranked = sorted(range(1, len(value)), key=lambda n: (-value[n], step["depth"][n], n))[:total]
    good = correct_nodes(step)
    return 1 + max((step["depth"][n] for n in ranked if n in good), default=0)


def judged_nodes(steps: list[dict]):
    """(depth, confidence, correct) of every node whose parent was correct (the root counts),
    where the target's continuation reaches its depth."""
    for step in steps:
        good, log_probs = correct_nodes(step), node_log_probs(step)
        for node in range(1, len(step["token"])):
            depth = step["depth"][node]
            if step["parent"][node] in good and depth <= len(step["continuation"]):
                yield depth, math.exp(log_probs[node]), node in good


def bin_of(depth: int, confidence: float) -> tuple[int, int]:
    """Depth (3 stands for 3 and deeper) and confidence decile."""
    return min(depth, 3), min(int(confidence * 10), 9)


def calibration(steps: list[dict]) -> dict:
    """Per depth, and per depth and confidence decile: nodes whose parent was correct, their
    mean confidence, and the share that were correct."""
    by_depth = defaultdict(lambda: [0, 0.0, 0])
    by_bin = defaultdict(lambda: [0, 0.0, 0])
    for depth, confidence, correct in judged_nodes(steps):
        for store in (by_depth[depth], by_bin[bin_of(depth, confidence)]):
            store[0] += 1
            store[1] += confidence
            store[2] += correct
    row = lambda n, s, c: {"nodes": n, "mean_confidence": round(s / n, 4), "correct_rate": round(c / n, 4)}
    return {"by_depth": {d: row(*v) for d, v in sorted(by_depth.items())},
            "by_confidence": {f"depth {'3+' if d == 3 else d}, p {b / 10:.1f}-{(b + 1) / 10:.1f}": row(*v)
                              for (d, b), v in sorted(by_bin.items())}}


def fitted_rates(steps: list[dict]) -> dict:
    """Per (depth, confidence decile): the correct rate, for the calibrated rule."""
    counts = defaultdict(lambda: [0, 0])
    for depth, confidence, correct in judged_nodes(steps):
        counts[bin_of(depth, confidence)][0] += 1
        counts[bin_of(depth, confidence)][1] += correct
    return {k: (c + 0.5) / (n + 1) for k, (n, c) in counts.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--draft-path", default=None)
    parser.add_argument("--questions", default=str(SPEC_BENCH))
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--limit", type=int, default=0, help="first N questions only (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--total", type=int, default=60)
    parser.add_argument("--out", default="runs/tree_calibration.json")
    args = parser.parse_args(argv)

    steps = record_steps(args)
    run_tau = sum(s["accept_length"] for s in steps) / len(steps)
    own = [replay(s, lambda lp, d: lp, args.total) for s in steps]
    mismatched = sum(a != s["accept_length"] for a, s in zip(own, steps) if s["complete"])
    report = {"model": args.model, "depth": args.depth, "total": args.total, "steps": len(steps),
              "run_tau": round(run_tau, 4), "replay_mismatches_on_complete_steps": mismatched,
              "calibration": calibration(steps), "replay_tau": {}}
    # Calibrated rule fitted on even-numbered steps, scored on odd ones (and the reverse).
    halves = [steps[0::2], steps[1::2]]
    rules = {"product of confidences (EAGLE-2)": lambda lp, d: lp}
    for gamma in (0.9, 0.8, 0.7):
        rules[f"depth discount {gamma}"] = lambda lp, d, g=gamma: lp + math.log(g)
    for name, rule in rules.items():
        lengths = [replay(s, rule, args.total) for s in steps]
        report["replay_tau"][name] = round(sum(lengths) / len(lengths), 4)
    cross = []
    for fit, test in ((halves[0], halves[1]), (halves[1], halves[0])):
        rates = fitted_rates(fit)
        rule = lambda lp, d, r=rates: math.log(r.get(bin_of(d, math.exp(lp)), 1e-3))
        cross += [replay(s, rule, args.total) for s in test]
    report["replay_tau"]["calibrated per depth and decile (cross-fitted)"] = round(sum(cross) / len(cross), 4)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report["calibration"]["by_depth"], indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "calibration"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
