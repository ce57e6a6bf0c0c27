"""Acceptance against training data: first-step acceptance and tau at fixed trees (1/1, 3/3,
6/60) for drafters of each recipe trained on more and more tokens, on prompts none trained on.

    python scripts/drafter_scaling.py --model smollm2 --out docs/bench/scaling-smollm2 \
        --point "EAGLE-2,1.9M,runs/e2-smollm2/drafter" \
        --point "EAGLE-3,0.4M,runs/e3-smollm2/checkpoint-600.pt" ...

A point is RECIPE,TOKENS,PATH: a drafter directory in any layout `--draft-path` reads, or an
EAGLE-3 training checkpoint (OUT/checkpoint-eagle3.pt copied at some step: the run as it stood
after that many tokens). Each point is benchmarked (`vocabspec bench`, fixed trees, greedy,
0 mismatches required) with plain decoding beside it. First-step acceptance is tau at the 1/1
tree less its one sure token. Writes scaling.json, scaling.md and a plot of tau against
training tokens (scaling.png) to --out.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

from vocabspec.benchmarks.bench import BenchConfig, _machine, run_bench
from vocabspec.training.eagle3_train import drafter_from_checkpoint
from vocabspec.training.train import parse_token_counts
from vocabspec.runtime.loading import load_model

TREES = ("1x1", "3x3", "6x60")


def drafter_dir(path: Path, model: str, into: Path) -> Path:
    """A drafter directory for `path`: itself, or a checkpoint's drafter saved under `into`."""
    if path.is_dir():
        return path
    target, _ = load_model(model, max_seq_len=64)
    drafter_from_checkpoint(path, target).save(into, layout="speculators")
    return into


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--point", action="append", required=True, help="RECIPE,TOKENS,PATH (repeat)")
    parser.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", required=True)
    parser.add_argument("--append", action="store_true", help="add to the points already in --out")
    args = parser.parse_args()
    out = Path(args.out)
    rows = json.loads((out / "scaling.json").read_text())["rows"] if args.append else []
    first = len(rows)
    for i, point in enumerate(args.point, start=first):
        recipe, amount, path = point.split(",", 2)
        where = drafter_dir(Path(path), args.model, out / "drafters" / f"{i}")
        methods = ("vanilla",) + tuple(f"eagle@{tree}" for tree in TREES)
        summary = run_bench(BenchConfig(questions=args.questions, model=args.model, methods=methods,
                                        out=str(out / f"bench-{i}"), max_new_tokens=args.max_new_tokens,
                                        per_category=args.per_category, draft_path=str(where)))
        taus = {tree: summary["methods"][f"eagle@{tree}"]["categories"]["overall"]["tau"] for tree in TREES}
        mismatches = sum(len(summary["methods"][f"eagle@{tree}"]["mismatched_questions"]) for tree in TREES)
        if mismatches:
            raise RuntimeError(f"{point}: {mismatches} answers differ from plain decoding")
        tokens = None if amount == "-" else parse_token_counts(amount)[amount]   # "-": a shipped drafter
        rows.append({"recipe": recipe, "tokens": tokens, "label": amount, "path": path,
                     "first_step_acceptance": round(taus["1x1"] - 1, 3),
                     **{f"tau_{tree}": round(taus[tree], 2) for tree in TREES}})
        print(json.dumps(rows[-1]), flush=True)
    header = (f"{args.model}: {Path(args.questions).name}, {args.per_category} question(s) per category, every turn, "
              f"{args.max_new_tokens} new tokens, greedy, fixed trees (depth x tokens); "
              f"{date.today()}, {_machine()}.")
    table = ["| recipe | training tokens | first-step acceptance | tau 1/1 | tau 3/3 | tau 6/60 |",
             "| --- | --- | --- | --- | --- | --- |"]
    table += [f"| {r['recipe']} | {r['label']} | {r['first_step_acceptance']:.3f} | {r['tau_1x1']:.2f} | "
              f"{r['tau_3x3']:.2f} | {r['tau_6x60']:.2f} |" for r in rows]
    (out / "scaling.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2))
    (out / "scaling.md").write_text(header + "\n\n" + "\n".join(table) + "\n")
    print(header + "\n\n" + "\n".join(table))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(TREES), figsize=(4 * len(TREES), 3.2), sharey=False)
    for axis, tree in zip(axes, TREES):
        for recipe in dict.fromkeys(r["recipe"] for r in rows):
            mine = sorted((r for r in rows if r["recipe"] == recipe), key=lambda r: r["tokens"] or 0)
            if mine[0]["tokens"] is None:        # a shipped drafter of unstated data: a level
                axis.axhline(mine[0][f"tau_{tree}"], linestyle="--", color="gray", label=recipe)
                continue
            axis.plot([r["tokens"] for r in mine], [r[f"tau_{tree}"] for r in mine], "o-", label=recipe)
        axis.set_xscale("log")
        axis.set_xlabel("training tokens")
        axis.set_title(f"tau, tree {tree.replace('x', '/')}")
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.suptitle(f"{args.model}: acceptance against training data ({Path(args.questions).name})")
    figure.tight_layout()
    figure.savefig(out / "scaling.png", dpi=120)


if __name__ == "__main__":
    main()
