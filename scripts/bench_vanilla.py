"""Vanilla greedy decoding: vocabspec's lean model against transformers' `generate` on the same
GGUF, both bundled models, both dtypes, measured side by side (interleaved) in one run.
The lean model runs twice: with its packed oneDNN weights (the default) and with plain
F.linear (VOCABSPEC_PACKED_LINEAR=0), which shows what the packing is worth.
Also the engine's overhead with an untrained (random) EAGLE drafter, with its time breakdown.

    python scripts/bench_vanilla.py --new-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date

import torch

from vocabspec.drafter import EagleDrafter, EagleProposer
from vocabspec.generate import Engine, GenerationConfig
from vocabspec.loading import load_model
from vocabspec.tokenizer import load_tokenizer

PROMPT = "Explain, step by step, how a refrigerator keeps food cold."


def prompt_ids(tokenizer):
    if tokenizer.chat_template:
        return tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    return tokenizer.encode(f"Question: {PROMPT}\nAnswer:")


def common_arguments(new_tokens: int) -> argparse.ArgumentParser:
    """Options shared by the vanilla-decoding comparisons (this script, bench_llamacpp.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    return parser


def time_hf(ref, ids, new_tokens):
    with torch.inference_mode():
        start = time.perf_counter()
        out = ref.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
    return out[0, len(ids):].tolist(), seconds


def bench_model(name, dtype_name, new_tokens, repeats, random_tree):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    dtype = getattr(torch, dtype_name)
    model, path = load_model(name, dtype=dtype)
    tokenizer = load_tokenizer(path)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    ids = prompt_ids(tokenizer)
    config = GenerationConfig(max_new_tokens=new_tokens, stop_on_eos=False)
    lean = Engine(model, tokenizer)
    spec = Engine(model, tokenizer, EagleProposer(EagleDrafter.random(model), **random_tree))
    lean.generate(ids, GenerationConfig(max_new_tokens=4))  # warm-up
    time_hf(ref, ids, 4)
    rows = {"lean": [], "lean_plain": [], "hf": [], "random_eagle": []}
    same = same_plain = True
    breakdown = None
    for _ in range(repeats):  # interleaved so drift hits all alike
        ours = lean.generate(ids, config)
        rows["lean"].append(ours.tokens_per_s)
        os.environ["VOCABSPEC_PACKED_LINEAR"] = "0"
        plain = lean.generate(ids, config)
        os.environ.pop("VOCABSPEC_PACKED_LINEAR")
        rows["lean_plain"].append(plain.tokens_per_s)
        same_plain &= plain.tokens == ours.tokens
        hf_tokens, seconds = time_hf(ref, ids, new_tokens)
        rows["hf"].append(new_tokens / seconds)
        same &= hf_tokens == ours.tokens
        r = spec.generate(ids, config)
        rows["random_eagle"].append(r.tokens_per_s)
        breakdown = {"prefill_s": r.prefill_seconds,
                     "draft_s": sum(s.draft_seconds for s in r.steps),
                     "verify_s": sum(s.verify_seconds for s in r.steps),
                     "total_s": r.seconds, "mean_accept_len": r.mean_accept_len}
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"model": name, "dtype": dtype_name, "lean_tok_s": round(med["lean"], 2),
            "lean_plain_tok_s": round(med["lean_plain"], 2), "hf_tok_s": round(med["hf"], 2), "lean_over_hf": round(med["lean"] / med["hf"], 3),
            "random_eagle_tok_s": round(med["random_eagle"], 2),
            "random_eagle_over_vanilla": round(med["random_eagle"] / med["lean"], 3),
            "packed_over_plain": round(med["lean"] / med["lean_plain"], 3), "same_tokens_as_hf": same,
            "same_tokens_packed_plain": same_plain, "random_eagle_breakdown": breakdown}


def main():
    parser = common_arguments(new_tokens=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tree = dict(depth=6, top_k=10, total_tokens=60)
    results = []
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            row = bench_model(name, dtype, args.new_tokens, args.repeats, tree)
            print(json.dumps(row), flush=True)
            results.append(row)
    meta = {"date": str(date.today()), "machine": f"{platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}",
            "new_tokens": args.new_tokens, "repeats": args.repeats, "tree": tree}
    print("\n| model | dtype | lean tok/s | lean, plain F.linear | transformers tok/s | lean / transformers | same tokens | "
          "random-drafter EAGLE tok/s | its ratio to vanilla | draft s / verify s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        b = r["random_eagle_breakdown"]
        print(f"| {r['model']} | {r['dtype']} | {r['lean_tok_s']} | {r['lean_plain_tok_s']} | {r['hf_tok_s']} | "
              f"{r['lean_over_hf']}x | {r['same_tokens_as_hf']} | {r['random_eagle_tok_s']} | "
              f"{r['random_eagle_over_vanilla']}x | {b['draft_s']:.2f} / {b['verify_s']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
