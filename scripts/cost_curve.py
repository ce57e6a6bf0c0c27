"""The cost curve: the target's forward time for 1 to 64 new tokens after a 256-token context,
per weight format, both bundled models (the same measurement the tree autotuner makes), with
the LM head over the rows verification scores first. Interleaved: every size and format in
turn within a round, medians over rounds.

    python scripts/cost_curve.py --repeats 7 --out docs/bench/cost_curve.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch

from vocabspec.formats import FORMATS

from vocabspec.autotune import forward_seconds
from vocabspec.loading import load_model

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3", help="comma-separated model names")
    parser.add_argument("--weights", default=",".join(FORMATS), help="comma-separated formats")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="new tokens per forward")
    parser.add_argument("--repeats", type=int, default=7, help="rounds (medians are reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads")
    parser.add_argument("--out", default=None, help="write the curves as JSON (and a PNG beside)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {"date": str(date.today()), "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "context": 256, "ms": {}}
    for name in args.models.split(","):
        for weights in args.weights.split(","):
            model, _ = load_model(name, weights=weights)
            # forward_seconds times sizes - 1 drafted tokens plus the root: n new tokens.
            timed = forward_seconds(model, [n - 1 for n in sizes], repeats=args.repeats)
            curve = {n: round(timed[n - 1] * 1e3, 2) for n in sizes}
            result["ms"].setdefault(name, {})[weights] = curve
            print(json.dumps({"model": name, "weights": weights, "forward_ms": curve}), flush=True)
            del model
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        plot(result, Path(args.out).with_suffix(".png"))
    print(json.dumps(result))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["ms"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        for weights, curve in result["ms"][name].items():
            sizes = [int(n) for n in curve]
            ax.plot(sizes, [curve[n] / curve[next(iter(curve))] for n in curve], marker="o", label=weights)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new tokens in the forward")
        ax.set_ylabel("time / one-token forward")
        ax.set_title(f"{name}: verification forward cost")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
