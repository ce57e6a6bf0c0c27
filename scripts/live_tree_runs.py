"""The live tree-size rule measured: a busy first call and the quiet calls after it, and the
tree each step keeps against the drafter's confidence.

1. Busy neighbours: from an empty cache, the README's command (`vocabspec generate --draft
   eagle`) runs once while `--busy` processes spin on the cores (the tuner times the machine
   then), and `--quiet-calls` times after they stop, on the same cache, alternating with as
   many on another cache tuned on the quiet machine; their medians side by side. Each call
   is a fresh process, as a user's; its tok/s and mean accepted length are the CLI's own.
   The whole sequence runs `--repeats` times on new caches (one call's tok/s swings several
   per cent between processes, and the first quiet call is one call): each repeat's ratios
   and their medians.
   Then a cache whose tuner entry is rewritten to "no tree pays" (0.81x): calls on it alternate
   with as many on the cache as tuned, medians side by side.
2. Sizes: in one process, greedy `--draft eagle` over Spec-Bench's first turns (one a
   category), each drafted step's kept tree size against the confidence of the root's best
   child (a plot, sizes.png).

    python scripts/live_tree_runs.py --model smollm2 --out docs/bench/live-tree
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
HELDOUT = ROOT / "vocabspec" / "data" / "heldout.jsonl"
STATS = re.compile(r"\[(\d+) tokens, ([\d.]+) s, ([\d.]+) tok/s(?:, mean accepted length ([\d.]+))?\]")


def call(model: str, prompt: str, tokens: int, cache: Path) -> dict:
    """One `vocabspec generate --draft eagle` in a fresh process over `cache`."""
    command = [sys.executable, "-m", "vocabspec.cli", "generate", "--model", model, "--draft", "eagle",
               "--max-new-tokens", str(tokens), *(["--chat"] if model == "smollm2" else []), prompt]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "VOCABSPEC_CACHE": str(cache)},
                          timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    found = STATS.findall(done.stderr)
    if not found:
        raise RuntimeError(f"no statistics line in: {done.stderr[-1000:]}")
    n, seconds, rate, tau = found[-1]
    return {"tokens": int(n), "tok_s": float(rate), "tau": float(tau or 1.0)}


def busy_run(model: str, prompt: str, tokens: int, busy: int, quiet_calls: int) -> dict:
    with tempfile.TemporaryDirectory() as fresh, tempfile.TemporaryDirectory() as busy_cache:
        # Each spinner ends by itself too, so that a killed run leaves no load behind.
        spin = "import time\nend = time.time() + 900\nwhile time.time() < end: pass"
        spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(busy)]
        try:
            first = call(model, prompt, tokens, Path(busy_cache))
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        print(f"busy first call: {first}", file=sys.stderr)
        # One call's tok/s swings up to 1.6x between processes: the calls on the two caches
        # alternate, and their medians are set side by side.
        after, quiet = [], []
        for i in range(quiet_calls):
            after.append(call(model, prompt, tokens, Path(busy_cache)))
            print(f"quiet call {i + 1} on that cache: {after[-1]}", file=sys.stderr)
            if i == 0:
                call(model, prompt, tokens, Path(fresh))         # the fresh cache's tuning, quiet
            quiet.append(call(model, prompt, tokens, Path(fresh)))
            print(f"quiet call {i + 1} on a cache tuned quiet: {quiet[-1]}", file=sys.stderr)
        tuned = json.loads((Path(busy_cache) / "autotune.json").read_text())
    verdicts = {key.split("|")[0]: (entry["depth"], entry["total_tokens"], entry.get("measured_speedup"))
                for key, entry in tuned.items() if "total_tokens" in entry}
    fresh_median = statistics.median(run["tok_s"] for run in quiet)
    return {"busy_first": first, "quiet_after_busy": after, "quiet_fresh": quiet, "busy_tuner_verdict": verdicts,
            "first_over_fresh": round(after[0]["tok_s"] / fresh_median, 3),
            "after_over_fresh": round(statistics.median(run["tok_s"] for run in after) / fresh_median, 3)}


def verdict_run(model: str, prompt: str, tokens: int, calls: int) -> dict:
    """A cache whose tuner entry says no tree pays (0.81x, as a busy first call once cached):
    calls on it alternate with as many on a copy of it as tuned, and their medians are compared."""
    with tempfile.TemporaryDirectory() as tuned_cache, tempfile.TemporaryDirectory() as scratch:
        call(model, prompt, tokens, Path(tuned_cache))                   # tunes, quiet
        verdict_cache = Path(scratch) / "cache"
        shutil.copytree(tuned_cache, verdict_cache)
        path = verdict_cache / "autotune.json"
        known = json.loads(path.read_text())
        for entry in known.values():
            if "total_tokens" in entry:
                entry.update(depth=0, total_tokens=0, measured_speedup=0.81)
        path.write_text(json.dumps(known))
        after, tuned = [], []
        for _ in range(calls):
            after.append(call(model, prompt, tokens, verdict_cache))
            tuned.append(call(model, prompt, tokens, Path(tuned_cache)))
    print(f"after a cached 0.81x verdict: {after} (as tuned: {tuned})", file=sys.stderr)
    tuned_median = statistics.median(run["tok_s"] for run in tuned)
    return {"as_tuned": tuned, "after_verdict": after, "first_over_tuned": round(after[0]["tok_s"] / tuned_median, 3),
            "after_over_tuned": round(statistics.median(run["tok_s"] for run in after) / tuned_median, 3)}


def sizes_run(model: str, tokens: int, out: Path) -> dict:
    from vocabspec import load

    lm = load(model, draft="eagle")
    sizing = lm.engine.proposer.sizing
    sizing.keep_sizes = True
    seen = {}
    for line in QUESTIONS.read_text().splitlines():
        question = json.loads(line)
        seen.setdefault(question["category"], question["turns"][0])
    for prompt in seen.values():
        lm.generate(prompt, max_new_tokens=tokens, chat=model == "smollm2")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    confidence, size = zip(*sizing.sizes)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(confidence, size, s=6, alpha=0.3)
    ax.set_xlabel("confidence of the root's best child")
    ax.set_ylabel("drafted nodes kept")
    ax.set_title(f"{model}: the tree each step keeps (live rule)")
    fig.tight_layout()
    fig.savefig(out / f"sizes-{model}.png", dpi=120)
    bins = {}
    for c, m in sizing.sizes:
        bins.setdefault(min(9, int(c * 10)), []).append(m)
    return {"steps": len(sizing.sizes),
            "mean_kept_by_confidence_decile": {f"{b / 10:.1f}": round(sum(v) / len(v), 2) for b, v in sorted(bins.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes beside the first call")
    parser.add_argument("--quiet-calls", type=int, default=4, help="calls on each cache, alternating")
    parser.add_argument("--repeats", type=int, default=3, help="busy sequences, each on new caches")
    parser.add_argument("--out", type=Path, default=Path("runs/live-tree"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompt = json.loads(HELDOUT.read_text().splitlines()[0])["turns"][0]
    runs = [busy_run(args.model, prompt, args.tokens, args.busy, args.quiet_calls) for _ in range(args.repeats)]
    busy = {"runs": runs, **{key: statistics.median(run[key] for run in runs)
                             for key in ("first_over_fresh", "after_over_fresh")}}
    result = {"model": args.model, "busy": busy,
              "verdict": verdict_run(args.model, prompt, args.tokens, args.quiet_calls),
              "sizes": sizes_run(args.model, 128, args.out)}
    (args.out / f"live-tree-{args.model}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
