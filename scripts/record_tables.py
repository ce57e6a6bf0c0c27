"""The benchmark record's tables from the runs scripts/record.sh made: Spec-Bench per model as
the median over runs (with the spread) of each method's speedup and tokens/s, tau and the
trees used; the peers comparison; the cost curve; faithfulness. Writes docs/bench/<model>/
(the last run's report and plots, and summary.md with the medians) and prints the markdown
that BENCHMARKS.md quotes.

    python scripts/record_tables.py --work runs/record --out docs/bench
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from vocabspec.runtime.files import cache_dir


def spec_bench(work: Path, model: str) -> tuple[list[str], dict]:
    runs = sorted(work.glob(f"specbench-{model}-run*"))
    summaries = [json.loads((run / "summary.json").read_text()) for run in runs
                 if (run / "summary.json").exists()]
    if not summaries:
        return [], {}
    methods = list(summaries[0]["methods"])
    table = {}
    for name in methods:
        rows = [s["methods"][name] for s in summaries]
        speed = [r["categories"]["overall"]["speedup"] for r in rows]
        toks = [r["categories"]["overall"]["tokens_per_s"] for r in rows]
        tau = [r["categories"]["overall"]["tau"] for r in rows]
        trees = sorted({f"{r['depth']}/{r['total_tokens']}" for r in rows if "depth" in r})
        mism = sum(len(r.get("mismatched_questions", [])) for r in rows)
        table[name] = {"speedup": statistics.median(speed), "low": min(speed), "high": max(speed),
                       "tokens_per_s": statistics.median(toks), "tau": statistics.median(tau),
                       "trees": trees, "mismatches": mism, "runs": len(rows)}
    lines = [f"| method | speedup (median of {len(summaries)}; spread) | tok/s | tau | trees (depth/tokens) | greedy mismatches |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, r in table.items():
        lines.append(f"| {name} | {r['speedup']:.2f}x ({r['low']:.2f}-{r['high']:.2f}) | {r['tokens_per_s']:.1f} | "
                     f"{r['tau']:.2f} | {', '.join(r['trees']) or '-'} | {r['mismatches']} |")
    # What a step costs, in vanilla forwards (vocabspec.benchmarks.bench): medians over the runs.
    costs = {name: [s["methods"][name]["step_cost"] for s in summaries if "step_cost" in s["methods"][name]]
             for name in methods}
    lines += ["", "Step cost in vanilla forwards (median of the runs): verification / drafting / "
              "prefill spread over the steps / other (the drafter's pass over the prompt, bookkeeping).", "",
              "| method | verification | drafting | prefill | other | whole step | tokens per step |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, rows in costs.items():
        if rows:
            med = {k: statistics.median(r.get(k, 0.0) for r in rows)
                   for k in ("verify", "draft", "prefill", "other", "whole", "tokens_per_step")}
            lines.append(f"| {name} | {med['verify']:.2f} | {med['draft']:.2f} | {med['prefill']:.2f} | "
                         f"{med['other']:.2f} | {med['whole']:.2f} | {med['tokens_per_step']:.2f} |")
    meta = summaries[-1]
    header = [f"Spec-Bench, {model}: {meta['questions']} questions (one per category), "
              f"max {meta['config']['max_new_tokens']} new tokens, greedy, weights {meta['target_weights']}; "
              f"{meta['date']} on {meta['machine']}."]
    return header + [""] + lines, table


def heads(out: Path) -> list[str]:
    """The draft heads at small trees, one run per model (record.sh's heads-MODEL runs):
    speedup, tau and the step's cost per head, the models side by side."""
    data = {model: json.loads((out / f"heads-{model}" / "summary.json").read_text())
            for model in ("smollm2", "gemma3") if (out / f"heads-{model}" / "summary.json").exists()}
    if not data:
        return []
    lines = [f"{model}: {d['date']} on {d['machine']}, weights {d['target_weights']}, one run."
             for model, d in data.items()]
    lines += ["", "| head @ tree | " + " | ".join(f"{m} speedup | tau | verification / drafting" for m in data) + " |",
              "| --- |" + " --- | --- | --- |" * len(data)]
    for name in next(iter(data.values()))["methods"]:
        cells = []
        for d in data.values():
            row = d["methods"].get(name)
            if row is None:
                cells += ["-", "-", "-"]
                continue
            overall, cost = row["categories"]["overall"], row.get("step_cost", {})
            cells += [f"{overall['speedup']:.2f}x", f"{overall['tau']:.2f}",
                      f"{cost.get('verify', 0):.2f} / {cost.get('draft', 0):.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def calibrations(path: Path) -> list[str]:
    """The autotuner's choices cached on this machine (VOCABSPEC_CACHE/autotune.json): the tree
    it chose per model, drafter head and format, and what its calibration measured against plain
    decoding on its own four prompts (32 tokens each)."""
    if not path.exists():
        return []
    known = json.loads(path.read_text())
    lines = ["| model | draft head | weights | chosen tree (depth/tokens) | calibration: predicted tok/s | "
             "calibration: measured vs plain |", "| --- | --- | --- | --- | --- | --- |"]
    for key, entry in known.items():
        if key.startswith("forward|") or "table" not in entry:
            continue
        parts = key.split("|")
        model, head, weights = parts[0], parts[2], parts[7]
        chosen = f"{entry['depth']}/{entry['total_tokens']}" if entry["total_tokens"] else "plain"
        row = entry["table"].get(f"{entry['depth']}/{entry['total_tokens']}") or \
            next((r for r in entry["table"].values() if r["total_tokens"] == entry["total_tokens"]), None)
        predicted = f"{row['tokens_per_s']:.1f}" if row and entry["total_tokens"] else "-"
        lines.append(f"| {model} | {head} | {weights} | {chosen} | {predicted} | {entry['measured_speedup']:.2f}x |")
    return lines if len(lines) > 2 else []


def peers(paths: list[Path]) -> list[str]:
    """One table, the models side by side: each engine's tok/s (median; spread) and its ratio
    to llama.cpp's plain decoding; mismatches against each format's own plain decoding summed."""
    data = [json.loads(p.read_text()) for p in paths if p.exists()]
    if not data:
        return []
    lines = [f"{d['model']}: {d['prompts']} prompts, {d['new_tokens']} new tokens, greedy, "
             f"{d['runs']} runs, {d['threads']} threads; {d['date']}, {d['machine']}, commit "
             f"{d['commit']}." for d in data]
    mismatches = sum(r.get("mismatches") or 0 for d in data for r in d["engines"].values())
    lines += [f"Greedy mismatches of vocabspec rows against their format's plain decoding: {mismatches}.", "",
              "| engine | " + " | ".join(f"{d['model']} tok/s (median; spread) | x llama.cpp" for d in data) + " |",
              "| --- |" + " --- | --- |" * len(data)]
    for name in data[0]["engines"]:
        cells = []
        for d in data:
            r = d["engines"].get(name)
            cells += [f"{r['tokens_per_s']} ({r['low']}-{r['high']})", f"{r['vs_llamacpp_plain']}x"] if r else ["-", "-"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def cost_curve(path: Path) -> list[str]:
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    sizes = list(next(iter(next(iter(data["ms"].values())).values())))
    lines = [f"Forward after a {data['context']}-token context, with the LM head over verification's "
             f"first rows, ms (median of rounds); {data['date']}.", "",
             "| model | weights | " + " | ".join(sizes) + " |", "| --- | --- |" + " --- |" * len(sizes)]
    for model, formats in data["ms"].items():
        for weights, curve in formats.items():
            lines.append(f"| {model} | {weights} | " + " | ".join(f"{curve[s]:.1f}" for s in sizes) + " |")
    return lines


def faithfulness(path: Path) -> list[str]:
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    lines = [f"Against the float32-dequantized model (`f32`), {data['prompts']} prompts, "
             f"{data['new_tokens']} greedy tokens; {data['date']}.", "",
             "| model | weights | max abs logit diff | identical answers | mean share before the first difference |",
             "| --- | --- | --- | --- | --- |"]
    for model, rows in data["models"].items():
        for weights, r in rows.items():
            diff = "-" if r["max_abs_logit_diff"] is None else r["max_abs_logit_diff"]
            lines.append(f"| {model} | {weights} | {diff} | {r['identical_answers']}/"
                         f"{data['prompts']} | {r['mean_share_before_first_difference']:.0%} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="runs/record", help="where record.sh put the runs")
    parser.add_argument("--out", default="docs/bench", help="the record's folder")
    parser.add_argument("--autotune", default=str(cache_dir() / "autotune.json"),
                        help="the autotuner's cache of tree choices on this machine")
    args = parser.parse_args()
    work, out = Path(args.work), Path(args.out)
    sections = {"Cost curve": cost_curve(out / "cost_curve.json"),
                "Faithfulness": faithfulness(out / "faithfulness.json")}
    for model in ("smollm2", "gemma3"):
        lines, _ = spec_bench(work, model)
        runs = sorted(work.glob(f"specbench-{model}-run*"))
        if runs:
            (out / model).mkdir(parents=True, exist_ok=True)
            for name in ("report.md", "speedup.png", "draft_breakdown.png", "run.json"):
                if (runs[-1] / name).exists():
                    shutil.copy(runs[-1] / name, out / model / name)
            (out / model / "summary.md").write_text("\n".join(lines) + "\n")
        sections[f"Spec-Bench, {model}"] = lines
    sections["Peers"] = peers([out / f"peers-{model}.json" for model in ("smollm2", "gemma3")])
    sections["Tree choices"] = calibrations(Path(args.autotune))
    sections["Draft heads at small trees"] = heads(out)
    for title, lines in sections.items():
        if lines:
            print(f"## {title}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
