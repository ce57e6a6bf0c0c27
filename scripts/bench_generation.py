"""Throughput of self-distillation's generator: the batch engine (what `vocabspec train` and
`generate --input` use) at each batch size, against the cost curve's tokens per second at as
many rows (measured in the same run), and against transformers' batched greedy generation (the
generator a user would otherwise pick) on the same prompts. Answers stop at end-of-sequence or
--new-tokens; a run's time includes every prompt's prefill, reported apart with the steps'
own share of the curve.

    python scripts/bench_generation.py --prompts 256 --batches 16,32 --hf-prompts 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

from vocabspec.serving.api import load
from vocabspec.decoding.cost_curve import forward_seconds
from vocabspec.decoding.batch import BatchLimits
from vocabspec.cli import set_threads
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.runtime.loading import resolve_model_path
from vocabspec.training.train import TrainConfig, _distill_prompts


def engine_speed(lm, prompts: list[list[int]], rows: int, new_tokens: int) -> dict:
    """Answer tokens per second of the batch engine with `rows` slots over all prompts."""
    config = GenerationConfig(max_new_tokens=new_tokens)
    window = max(map(len, prompts)) + new_tokens + 1
    batch = lm.batch(BatchLimits(max_batch=rows, max_waiting=len(prompts), window=window))
    lm._batch = None                         # a fresh engine per size
    start = time.perf_counter()
    results = batch.generate(prompts, config)
    seconds = time.perf_counter() - start
    tokens = sum(r.new_tokens for r in results)
    return {"answers": len(results), "answer_tokens": tokens, "prompt_tokens": sum(map(len, prompts)),
            "seconds": round(seconds, 2), "answer_tok_s": round(tokens / seconds, 1), "steps": batch.stats()}


def load_transformers(path, dtype: torch.dtype, device: str = "cpu"):
    """transformers' model of `path` (a GGUF file, read by transformers' gguf support, or a
    model directory), in `dtype` on `device`."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return hf.to(device).eval()


def transformers_speed(hf, prompts: list[list[int]], rows: int, new_tokens: int, eos: int,
                       progress: bool = True) -> dict:
    """Answer tokens (up to each row's end-of-sequence) per second of transformers' generate
    (`hf`, from `load_transformers`), left-padded batches of `rows` prompts sorted by length."""
    ordered = sorted(prompts, key=len)
    tokens, start = 0, time.perf_counter()
    for first in tqdm(range(0, len(ordered), rows), desc=f"transformers {hf.dtype}", unit="batch",
                      disable=not progress):
        group = ordered[first:first + rows]
        width = max(map(len, group))
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in group], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=hf.device)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                              max_new_tokens=new_tokens, pad_token_id=eos)
        for row in out[:, width:].tolist():
            tokens += row.index(eos) + 1 if eos in row else len(row)
    seconds = time.perf_counter() - start
    return {"answers": len(prompts), "answer_tokens": tokens, "seconds": round(seconds, 2),
            "answer_tok_s": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=256, help="self-distillation prompts answered")
    parser.add_argument("--batches", default="16,32", help="batch engine slots (comma-separated)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hf-prompts", type=int, default=64, help="of those, answered by transformers (0: none)")
    parser.add_argument("--hf-dtype", default="bfloat16")
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="fixed threads (default: all, governed)")
    args = parser.parse_args()
    set_threads(args.threads)
    lm = load(args.model)
    config = TrainConfig.of(model=args.model, conversations=64, distill_start=5449, self_distill=args.prompts)
    prompts = _distill_prompts(config, lm.tokenizer)
    batches = [int(b) for b in args.batches.split(",")]
    rows = {}
    for size in batches:
        rows[size] = engine_speed(lm, prompts, size, args.new_tokens)
        print(json.dumps({"generator": "batch engine", "rows": size, **rows[size]}), flush=True)
    curve = forward_seconds(lm.engine.model, [n - 1 for n in batches], repeats=7)
    for size in batches:
        ideal = size / curve[size - 1]
        run = rows[size]
        # The steps alone: the tokens they made (each answer's first comes from its prefill).
        stepping = (run["answer_tokens"] - run["answers"]) / run["steps"]["steps_seconds"]
        print(json.dumps({"rows": size, "curve_ms": round(curve[size - 1] * 1e3, 2),
                          "curve_tok_s": round(ideal, 1), "of_curve": round(run["answer_tok_s"] / ideal, 3),
                          "steps_of_curve": round(stepping / ideal, 3),
                          "prefill_share": round(run["steps"]["prefill_seconds"] / run["seconds"], 3)}), flush=True)
    if args.hf_prompts:
        eos = lm.tokenizer.eos_token_id or 0
        model = load_transformers(resolve_model_path(args.model), getattr(torch, args.hf_dtype))
        hf = transformers_speed(model, prompts[:args.hf_prompts], args.hf_batch, args.new_tokens, eos)
        print(json.dumps({"generator": f"transformers {args.hf_dtype}", "rows": args.hf_batch, **hf}), flush=True)


if __name__ == "__main__":
    main()
