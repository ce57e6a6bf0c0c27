"""What a plain decoding step spends outside the native engine: Python, checks, bookkeeping.

Every function of the native library is wrapped to add up its time; plain greedy decoding then
runs held-out prompts in rounds, and each token's wall time is split into the time inside those
calls and the rest (the loop's own). Medians over rounds. It reads only what every version of
the package has (vocabspec.load, LanguageModel.generate, native.library), so it measures an
older checkout too (PYTHONPATH=its root): the A/B of scripts/ab_commits.py, per step.

    python scripts/step_overhead.py --models smollm2,gemma3 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import vocabspec
from vocabspec.runtime import native

HELDOUT = Path(vocabspec.__file__).resolve().parent / "data" / "heldout.jsonl"


class NativeClock:
    """Wraps every vs_* function of the loaded library: `seconds` inside them since reset."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        lib = native.library()
        for name in dir(lib):
            if name.startswith("vs_"):
                setattr(lib, name, self._timed(getattr(lib, name)))

    def _timed(self, fn):
        def call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        call.argtypes, call.restype = getattr(fn, "argtypes", None), getattr(fn, "restype", None)
        return call


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    texts = [r["turns"][0] for r in rows if r["category"] == "code"][:args.prompts]
    out = {}
    for model in args.models.split(","):
        lm = vocabspec.load(model)
        chat = model == "smollm2"
        clock = NativeClock()
        per_token = {"total_ms": [], "native_ms": [], "outside_ms": [], "calls": []}
        for round_ in range(args.rounds + 1):          # the first warms up
            total = native_time = tokens = calls = 0
            for text in texts:
                prompt = text if chat else f"Question: {text}\n\nAnswer:"
                clock.seconds, clock.calls = 0.0, 0
                result = lm.generate(prompt, chat=chat, max_new_tokens=args.max_new_tokens)
                total += result.seconds
                native_time += clock.seconds
                tokens += result.new_tokens
                calls += clock.calls
            if round_:
                per_token["total_ms"].append(total / tokens * 1e3)
                per_token["native_ms"].append(native_time / tokens * 1e3)
                per_token["outside_ms"].append((total - native_time) / tokens * 1e3)
                per_token["calls"].append(calls / tokens)
        out[model] = {k: round(statistics.median(v), 4) for k, v in per_token.items()}
        print(json.dumps({"model": model, **out[model]}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
