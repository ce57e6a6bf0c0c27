"""Native build variants against each other, in one process: each variant's forward cost curve.

A kernel constant (VOCABSPEC_NATIVE_DEFINES, e.g. -DVS_PF=0 for no prefetch) changes timing only,
never a bit. Timed in separate processes, two builds differ by more than the change: a process's
memory layout and the machine's state move a token's time by a tenth or more from one run to
the next. So every variant's library is loaded here side by side, the model once, and the
variants take turns round by round over the same weights and cache (forward_seconds: each size
in turn, medians over rounds).

    python scripts/native_variants.py --model gemma3 --rounds 12 --sizes 0,1,3,7 \\
        --variant off=-DVS_PF=0 --variant on=
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from vocabspec.benchmarks.bench import _machine
from vocabspec.decoding.cost_curve import forward_seconds
from vocabspec.runtime import native
from vocabspec.runtime.loading import load_model


def build(defines: str):
    """The library of one variant, loaded as the engine loads its own (native.load_build)."""
    os.environ["VOCABSPEC_NATIVE_DEFINES"] = defines
    try:
        return native.load_build()
    finally:
        os.environ.pop("VOCABSPEC_NATIVE_DEFINES")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="bundled name or GGUF file")
    parser.add_argument("--weights", default="gguf-a8", help="weight format")
    parser.add_argument("--variant", action="append", required=True,
                        help="LABEL=DEFINES (DEFINES: -D options, or empty for the default build); twice or more")
    parser.add_argument("--sizes", default="0,1,3,7", help="drafted tokens per forward (rows = size + 1)")
    parser.add_argument("--rounds", type=int, default=10, help="turns per variant (medians are reported)")
    parser.add_argument("--repeats", type=int, default=3, help="timings of each size within a turn")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    variants = dict(spec.split("=", 1) for spec in args.variant)
    if len(variants) < 2 or any(not label for label in variants):
        parser.error("--variant LABEL=DEFINES, at least two distinct labels")
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    libs = {label: build(defines) for label, defines in variants.items()}
    native._lib = next(iter(libs.values()))
    model, _ = load_model(args.model, weights=args.weights)
    ms = {label: {n: [] for n in sizes} for label in libs}
    for _ in range(args.rounds):
        for label, lib in libs.items():
            native._lib = lib        # the stack's structs and caches are the library's inputs only
            for n, seconds in forward_seconds(model, sizes, repeats=args.repeats).items():
                ms[label][n].append(seconds * 1e3)
    medians = {label: {str(n + 1): round(statistics.median(runs), 3) for n, runs in per.items()}
               for label, per in ms.items()}
    first = next(iter(medians.values()))
    for label, row in medians.items():
        print(f"{label:>12}: " + "  ".join(f"{rows} rows {t:.2f} ms ({t / first[rows]:.2f})" for rows, t in row.items()))
    print(json.dumps({"model": args.model, "weights": args.weights, "machine": _machine(),
                      "rounds": args.rounds, "variants": variants, "forward_ms_by_rows": medians}))


if __name__ == "__main__":
    main()
