"""The cost curve: the target's forward time for 1 to 64 new tokens after a 256-token context (or others,
--contexts), per weight format, both bundled models (the same measurement the tree autotuner makes), with
the LM head over the rows verification scores first. Interleaved: every size and format in
turn within a round, medians over rounds.

    python scripts/cost_curve.py --repeats 7 --out docs/bench/cost_curve.json
    python scripts/cost_curve.py --weights gguf-a8 --contexts 256,1024,2048   # longer contexts
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch

from vocabspec.runtime.formats import FORMATS

from vocabspec.decoding.cost_curve import forward_seconds
from vocabspec.runtime.loading import load_model

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3", help="comma-separated model names")
    parser.add_argument("--weights", default=",".join(FORMATS), help="comma-separated formats")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="new tokens per forward")
    parser.add_argument("--contexts", default="256",
                        help="comma-separated cached tokens before the new ones (one curve each)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds (medians are reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads")
    parser.add_argument("--out", default=None, help="write the curves as JSON (and a PNG beside)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {"date": str(date.today()), "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "context": 256, "ms": {}}
    contexts = [int(c) for c in args.contexts.split(",")]
    for name in args.models.split(","):
        for weights in args.weights.split(","):
            model, _ = load_model(name, weights=weights)
            for context in contexts:
                # forward_seconds times sizes - 1 drafted tokens plus the root: n new tokens.
                timed = forward_seconds(model, [n - 1 for n in sizes], context=context, repeats=args.repeats)
                curve = {n: round(timed[n - 1] * 1e3, 2) for n in sizes}
                # The 256-token curve under the format's name, others under "format @context".
                label = weights if context == 256 else f"{weights} @{context}"
                result["ms"].setdefault(name, {})[label] = curve
                print(json.dumps({"model": name, "weights": weights, "context": context, "forward_ms": curve}),
                      flush=True)
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
            base = result["ms"][name][weights.split(" @")[0]]
            ax.plot(sizes, [curve[n] / base[next(iter(base))] for n in curve], marker="o", label=weights)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new tokens in the forward")
        ax.set_ylabel("time / one-token forward at 256")
        ax.set_title(f"{name}: verification forward cost")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
