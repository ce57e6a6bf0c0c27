"""Vanilla greedy decoding: vocabspec's lean model against llama.cpp (llama-cpp-python) on the
same GGUF file, both bundled models, measured side by side (interleaved) in one run.

llama.cpp computes on the file's 4-bit blocks directly; our model dequantizes them to
float32/bfloat16, so it streams 4-8x more bytes per token. This is the reference a CPU user
would compare against. Needs `pip install llama-cpp-python` (builds from source).

    python scripts/bench_llamacpp.py --new-tokens 48 --repeats 3
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench_vanilla import common_arguments, prompt_ids
from vocabspec.generate import Engine, GenerationConfig
from vocabspec.loading import load_model
from vocabspec.tokenizer import load_tokenizer


def time_llamacpp(llm, ids, new_tokens) -> float:
    """Seconds for llama.cpp to prefill `ids` and decode `new_tokens` greedily."""
    start = time.perf_counter()
    for count, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True), start=1):
        if count == new_tokens:
            break
    return time.perf_counter() - start


def main():
    from llama_cpp import Llama

    args = common_arguments(new_tokens=48).parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        engines = {}
        for dtype in args.dtypes.split(","):
            model, path = load_model(name, dtype=getattr(torch, dtype))
            tokenizer = load_tokenizer(path)
            engines[dtype] = Engine(model, tokenizer)
        ids = prompt_ids(tokenizer)
        llm = Llama(model_path=str(path), n_ctx=1024, n_threads=args.threads, n_batch=512, verbose=False)
        config = GenerationConfig(max_new_tokens=args.new_tokens, stop_on_eos=False)
        time_llamacpp(llm, ids, 4)
        for engine in engines.values():
            engine.generate(ids, GenerationConfig(max_new_tokens=4))
        rows = {key: [] for key in ["llama.cpp", *engines]}
        for _ in range(args.repeats):
            seconds = time_llamacpp(llm, ids, args.new_tokens)
            rows["llama.cpp"].append(args.new_tokens / seconds)
            for dtype, engine in engines.items():
                rows[dtype].append(engine.generate(ids, config).tokens_per_s)
        med = {k: round(statistics.median(v), 2) for k, v in rows.items()}
        print(json.dumps({"model": name, "tokens_per_s": med,
                          **{f"lean_{d}_over_llamacpp": round(med[d] / med["llama.cpp"], 3) for d in engines}}),
              flush=True)


if __name__ == "__main__":
    main()
