"""What sizing each step's tree can gain over one size for every step, on the trees the live rule
drafts: the rule's own choice against every fixed size and against hindsight.

The live rule (speculation/live_tree.py) drafts a tree of candidates each step and keeps the m
best. This script runs it (`--draft eagle`, greedy, 128 tokens on the 13 Spec-Bench first turns
and the held-out prompts) and records each drafted step's candidates in value order with their
calibrated chances. Greedy output is plain decoding's, so each candidate's fate is known whether
or not it was verified: it is on the accepted path iff its tokens are the ones the output has
next. Each step is then replayed under other choices of m, its measured time changed only by
the rows it would verify (the rule's cost curve, as it stood at the end):

- `fixed m`: the m best candidates every step;
- `rule`: the rule's own choice (the measured run, replayed: the check that replay and run agree);
- `confident`: per step the m that maximises the calibrated chances' expected drafts less an
  exchange rate times the rows' cost, the rate the one that maximises the whole run's speed
  (chosen in hindsight, and free of the rule's own costs: the most any rule that sizes a tree
  from the drafter's calibrated confidence can reach on these candidates);
- `hindsight`: per step the m that an oracle knowing the outcome would keep, its exchange rate
  of rows for tokens the one that maximises the whole run's speed (no rule can reach it: its
  gap over `rule` is what knowing the outcome is worth, the part confidence cannot give).

Also the calibration's check: the tokens the chances predict for the m best, against those the
outcomes give. Plain steps (the rule drafting nothing) count the same in every policy.

    python scripts/sizing_headroom.py --model smollm2 --rounds 2 --out docs/bench/live-tree/headroom-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def accepted(step: dict, m: int) -> int:
    """Drafts accepted had the step kept its m best candidates: the on-path ones, by depth, while
    each is among them."""
    count = 0
    for rank in step["path"]:           # the on-path candidates' ranks, shallowest first
        if rank >= m:
            break
        count += 1
    return count


def replay(steps: list[dict], plain_seconds: float, plain_tokens: int, pick, costs) -> float:
    """tok/s of the run had each drafted step kept `pick(step)` candidates."""
    tokens, seconds = plain_tokens, plain_seconds
    for step in steps:
        m = min(pick(step), len(step["chances"]))
        tokens += 1 + accepted(step, m)
        seconds += step["seconds"] + costs(1 + m) - costs(1 + step["kept"])
    return tokens / seconds


def best_rate(steps, plain_seconds, plain_tokens, costs, gain) -> float:
    """The best run when each step keeps the m maximising gain(step, m) less `rate` times its
    rows' cost, the rate swept around the run's own."""
    own = replay(steps, plain_seconds, plain_tokens, lambda s: s["kept"], costs)
    best = 0.0
    for i in range(-60, 61):
        rate = own * 1.03 ** i      # tokens a second
        pick = lambda s: max(range(len(s["chances"]) + 1), key=lambda m: gain(s, m) - rate * costs(1 + m))
        best = max(best, replay(steps, plain_seconds, plain_tokens, pick, costs))
    return best


def hindsight(steps, plain_seconds, plain_tokens, costs) -> float:
    """The best run an oracle that knows each step's outcome reaches."""
    return best_rate(steps, plain_seconds, plain_tokens, costs, accepted)


def confident(steps, plain_seconds, plain_tokens, costs) -> float:
    """The best run a rule reaches that keeps, per step, the m best for the calibrated chances."""
    return best_rate(steps, plain_seconds, plain_tokens, costs, lambda s, m: sum(s["chances"][:m]))


def record(model: str, rounds: int) -> tuple[list[dict], float, int, object]:
    """Run the live rule; its drafted steps (candidates' chances in value order, on-path ranks,
    the candidates kept, the step's measured seconds) and its plain steps' seconds and tokens."""
    from live_vs_static import prompts, proposer
    from vocabspec.decoding.batch import Engine
    from vocabspec.decoding.generate import GenerationConfig
    from vocabspec.runtime.loading import load_model
    from vocabspec.runtime.prompts import encode_conversation
    from vocabspec.runtime.tokenizer import load_tokenizer

    target, path = load_model(model)
    tokenizer = load_tokenizer(path)
    engine = Engine(target, tokenizer, proposer(target, tokenizer, model, "eagle"))
    sizing = engine.proposer.sizing
    drafted: list[dict | None] = []
    choose = sizing.choose

    def recording_choose(tree, *args):
        kept = choose(tree, *args)
        ranks, values, depths = tree.ranks.tolist(), tree.values.tolist(), tree.depths.tolist()
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        order = sorted(range(1, len(ranks)), key=ranks.__getitem__)
        paths = []
        for row in order:
            path, node = [], row
            while node > 0:
                path.append(tokens[node])
                node = parents[node]
            paths.append(path[::-1])
        drafted[-1] = {"chances": [sizing.calibration.chance(depths[r], values[r]) for r in order],
                       "paths": paths, "kept": kept.size}
        return kept

    reads_rows = engine.proposer.reads_rows

    def recording_reads_rows():         # asked once a step, whether it drafts or not
        drafted.append(None)
        return reads_rows()

    sizing.choose, engine.proposer.reads_rows = recording_choose, recording_reads_rows
    steps, plain_seconds, plain_tokens = [], 0.0, 0
    items = prompts()
    for round_ in range(rounds):
        for _, text in items:
            ids = encode_conversation(tokenizer, [("user", text)], answer_open=True)
            drafted.clear()
            result = engine.generate(ids, GenerationConfig(max_new_tokens=128))
            if len(drafted) != len(result.steps):
                raise RuntimeError(f"{len(drafted)} proposals for {len(result.steps)} steps")
            out, at = result.tokens, 0
            for step, record_ in zip(result.steps, drafted):
                seconds = step.draft_seconds + step.verify_seconds
                if record_ is None or at + step.accept_length >= len(out):    # plain, or cut at the end
                    plain_seconds, plain_tokens = plain_seconds + seconds, plain_tokens + step.accept_length
                else:
                    following = out[at + 1:]
                    on_path = [rank for rank, p in enumerate(record_["paths"]) if following[:len(p)] == p]
                    on_path.sort(key=lambda rank: len(record_["paths"][rank]))
                    if accepted({"path": on_path}, record_["kept"]) != step.accept_length - 1:
                        raise RuntimeError("a replayed step does not accept what it accepted")
                    steps.append({"chances": record_["chances"], "path": on_path, "kept": record_["kept"],
                                  "seconds": seconds})
                at += step.accept_length
        print(f"round {round_ + 1} of {rounds}: {len(steps)} drafted steps", flush=True)
    return steps, plain_seconds, plain_tokens, sizing.costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    args = parser.parse_args()
    started = time.time()
    steps, plain_seconds, plain_tokens, costs = record(args.model, args.rounds)
    most = max(len(s["chances"]) for s in steps)
    fixed = {m: replay(steps, plain_seconds, plain_tokens, lambda s, m=m: m, costs) for m in range(most + 1)}
    rule = replay(steps, plain_seconds, plain_tokens, lambda s: s["kept"], costs)
    oracle = hindsight(steps, plain_seconds, plain_tokens, costs)
    expected = confident(steps, plain_seconds, plain_tokens, costs)
    best_m = max(fixed, key=fixed.get)
    calibration = [{"m": m, "predicted": round(sum(sum(s["chances"][:m]) for s in steps) / len(steps), 3),
                    "outcomes": round(sum(accepted(s, m) for s in steps) / len(steps), 3)} for m in range(most + 1)]
    result = {"model": args.model, "rounds": args.rounds, "drafted_steps": len(steps),
              "row_ms": {n: round(costs(n) * 1e3, 3) for n in range(1, most + 2)},
              "tok_s": {"rule": round(rule, 1), "confident": round(expected, 1), "hindsight": round(oracle, 1),
                        **{f"fixed {m}": round(v, 1) for m, v in fixed.items()}},
              "rule_over_best_fixed": round(rule / fixed[best_m], 3), "best_fixed": best_m,
              "confident_over_best_fixed": round(expected / fixed[best_m], 3),
              "hindsight_over_best_fixed": round(oracle / fixed[best_m], 3), "calibration": calibration,
              "seconds": round(time.time() - started)}
    print(json.dumps({k: v for k, v in result.items() if k != "calibration"}, indent=1))
    for row in calibration:
        print(f"m={row['m']}: chances predict {row['predicted']:.3f} drafts accepted, outcomes {row['outcomes']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
