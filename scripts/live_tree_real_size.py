"""The live tree rule at a real model's size: a GGUF of a real shape (scripts/gguf_shapes.py) with
an EAGLE-2 drafter of its widths and random weights, a drafter that never guesses right, so
every row it drafts is lost. Plain decoding, the same drafter on a fixed tree, and the live rule
(its costs this file's own forward curve, no tuned verdict as its prior), each generation in
turn, tokens checked against plain decoding's; beside `llama-bench` on the same file.

    python scripts/live_tree_real_size.py --model llama1b-q4km.gguf --rounds 2 --llamacpp ~/.lcpp/bin
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

import torch

FIXED = dict(depth=2, top_k=4, total_tokens=3)


def llama_bench(binary_dir: Path, model: str, tokens: int) -> float:
    """llama.cpp's own decode rate on the file (tg, 2 threads)."""
    out = subprocess.run([str(binary_dir / "llama-bench"), "-m", model, "-p", "0", "-n", str(tokens), "-r", "2",
                          "-t", "2", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    from vocabspec.decoding.batch import Engine
    from vocabspec.decoding.generate import GenerationConfig
    from vocabspec.runtime import native
    from vocabspec.runtime.loading import load_model
    from vocabspec.runtime.tokenizer import load_tokenizer
    from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
    from vocabspec.speculation.vocab.draft_vocab import FullVocab
    from vocabspec.tuning.autotune import forward_curve
    from vocabspec.tuning.proposers import live_sizing

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--llamacpp", type=Path, default=None, help="llama.cpp's bin folder (llama-bench)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model, path = load_model(args.model)
    tokenizer = load_tokenizer(path)
    drafter = EagleDrafter.random(model, seed=1, dtype=torch.bfloat16)
    drafter.pack("q8i" if native.has_int8() else "bf16")
    head = FullVocab(model.packed_head)
    live = EagleProposer(drafter, draft_vocab=head, depth=FIXED["depth"], top_k=FIXED["top_k"], total_tokens=8)
    live.sizing = live_sizing(model, forward_curve(model), 0.0, 1.0, FIXED["total_tokens"], FIXED["depth"], 8)
    engines = {"plain": Engine(model, tokenizer),
               "eagle@2x3": Engine(model, tokenizer, EagleProposer(drafter, draft_vocab=head, **FIXED)),
               "eagle live": Engine(model, tokenizer, live)}
    heldout = Path(__file__).resolve().parents[1] / "vocabspec" / "data" / "heldout.jsonl"
    prompts = [tokenizer.encode(json.loads(line)["turns"][0]) for line in heldout.read_text().splitlines()[:4]]
    config = GenerationConfig(max_new_tokens=args.tokens, stop_on_eos=False)
    rates = {name: [] for name in engines}
    steps = {name: [0, 0] for name in engines}
    for round_ in range(args.rounds):
        for ids in prompts:
            plain = None
            for name, engine in engines.items():
                result = engine.generate(ids, config)
                plain = plain or result.tokens
                if result.tokens != plain:
                    raise RuntimeError(f"{name} did not give plain decoding's tokens")
                rates[name].append(result.tokens_per_s)
                steps[name][0] += result.new_tokens
                steps[name][1] += len(result.steps)
        print(f"round {round_ + 1} of {args.rounds}", flush=True)
    table = {name: {"tok_s": round(statistics.median(r), 2), "tau": round(steps[name][0] / steps[name][1], 2)}
             for name, r in rates.items()}
    for row in table.values():
        row["x_plain"] = round(row["tok_s"] / table["plain"]["tok_s"], 3)
    result = {"model": Path(args.model).name, "tokens": args.tokens, "rounds": args.rounds, "table": table}
    if args.llamacpp:
        result["llama_bench_tg"] = round(llama_bench(args.llamacpp, args.model, args.tokens), 2)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
