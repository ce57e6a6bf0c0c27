"""Throughput of self-distillation's generator (transformers, batched greedy) per dtype and
batch size: the numbers behind `vocabspec train`'s choice of bfloat16 where the CPU multiplies
it fast and float32 elsewhere. Every batch decodes exactly --new-tokens tokens per row (no early
stop), on self-distillation prompts of SmolLM2's round-9 range (distill-start 5449).

    python scripts/bench_generation.py --dtypes float32,bfloat16 --batches 32,64
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vocabspec.loading import resolve_model_path
from vocabspec.tokenizer import load_tokenizer
from vocabspec.train import TrainConfig, _distill_prompts, left_padded, load_generator


def time_batch(hf, prompts: list[list[int]], pad: int, new_tokens: int) -> float:
    """Answer tokens per second for one left-padded batch."""
    ids, mask = left_padded(prompts, pad)
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, pad_token_id=pad)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    batches = [int(b) for b in args.batches.split(",")]
    config = TrainConfig(model=args.model, conversations=64, distill_start=5449,
                         self_distill=2100 + max(batches))
    prompts = _distill_prompts(config, tokenizer)[2100:]
    pad = tokenizer.eos_token_id or 0
    for name in args.dtypes.split(","):
        hf = load_generator(path, getattr(torch, name))
        for size in batches:
            speed = time_batch(hf, prompts[:size], pad, args.new_tokens)
            print(json.dumps({"dtype": name, "batch": size, "answer_tok_s": round(speed, 1)}), flush=True)
        del hf


if __name__ == "__main__":
    main()
